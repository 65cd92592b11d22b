"""The chat handler's replies from scripted model text (a stand-in engine yields it in pieces): the
reasoning, content and tool calls of a reply, and the same from its stream of chunks however the
text is cut, with OpenAI's tool-call deltas (the first names the call, the later ones carry its
arguments) and finish reasons."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from moe.engine.input_processor import ProcessedPrompt
from moe.entrypoints.serve.chat_handler import ChatHandler
from moe.entrypoints.serve.protocol import ChatCompletionRequest, ErrorResponse
from moe.entrypoints.serve.tool_choice import ToolSettings
from moe.outputs import CompletionOutput, RequestOutput
from tests.parsers.helpers import splits

PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


class _Input:
    def __init__(self) -> None:
        self.seen: dict = {}

    def process_chat(self, messages, add_generation_prompt, chat_template, tools, **kwargs):
        self.seen.update(tools=tools, kwargs=kwargs)
        return ProcessedPrompt(PROMPT, [1, 2, 3])

    def check_params(self, params):
        self.seen["params"] = params

    def check_context_length(self, *args):
        pass

    def truncate(self, p, k):
        return p


class _Engine:
    """What ChatHandler uses of AsyncLLM; generate yields `pieces` as the model's text."""

    def __init__(self, pieces: list[str], finish_reason: str = "stop") -> None:
        self.pieces, self.finish_reason = pieces, finish_reason
        self.input = _Input()
        self.info = SimpleNamespace(tokenizer=None)

    async def run_input(self, fn, body):
        return fn(body)

    async def generate(self, prompt, params, request_id):
        self.params = params
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield RequestOutput(request_id, prompt.prompt, prompt.prompt_token_ids,
                                [CompletionOutput(0, piece, [7], finish_reason=self.finish_reason if last else None)],
                                last)


def _handler(pieces, reasoning="qwen3", auto=True, finish_reason="stop", tool_parser="hermes"):
    engine = _Engine(pieces, finish_reason)
    tools = ToolSettings(enable_auto_tool_choice=auto, tool_call_parser=tool_parser if auto else None)
    return ChatHandler(engine, "m", tools, reasoning), engine


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather in Paris?"}], **kw})


def reply(pieces, body, **kw) -> dict:
    handler, _ = _handler(pieces, **kw)
    return asyncio.run(handler.create(body))["choices"][0]


def streamed(pieces, body, **kw) -> list[dict]:
    """The stream's chunk choices (the [DONE] line and usage left out)."""
    handler, _ = _handler(pieces, **kw)

    async def run():
        lines = [line async for line in await handler.create(body.model_copy(update={"stream": True}))]
        return [json.loads(line[6:])["choices"][0] for line in lines if line != "data: [DONE]\n\n"]
    return asyncio.run(run())


def joined(chunks: list[dict]) -> dict:
    """A message put together from chunk deltas as an OpenAI client does, and the finish_reason."""
    message = {"role": chunks[0]["delta"]["role"], "content": "", "reasoning": "", "tool_calls": []}
    for c in chunks:
        d = c["delta"]
        message["content"] += d.get("content") or ""
        message["reasoning"] += d.get("reasoning") or ""
        assert d.get("reasoning") == d.get("reasoning_content")
        for t in d.get("tool_calls", []):
            if "id" in t:  # a call's first delta: index, id, type, name
                assert t["index"] == len(message["tool_calls"]) and t["type"] == "function"
                message["tool_calls"].append({"id": t["id"], "type": "function",
                                              "function": {"name": t["function"]["name"], "arguments": ""}})
            else:
                assert set(t) == {"index", "function"} and set(t["function"]) == {"arguments"}
            message["tool_calls"][t["index"]]["function"]["arguments"] += t["function"]["arguments"]
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    return {**message, "finish_reason": chunks[-1]["finish_reason"]}


def comparable(choice: dict) -> dict:
    m = choice["message"]
    assert m["reasoning"] == m["reasoning_content"]
    calls = m.get("tool_calls", [])
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    return {"role": m["role"], "content": m["content"] or "", "reasoning": m["reasoning"] or "",
            "tool_calls": [c["function"] for c in calls], "finish_reason": choice["finish_reason"]}


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [c["function"] for c in message["tool_calls"]]}


REASONING_AND_CALL = ("<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n"
                      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_reasoning_content_and_auto_tool_call_whole_and_streamed_however_cut():
    body = _body(tools=TOOLS)
    whole = comparable(reply([REASONING_AND_CALL], body))
    assert whole == {"role": "assistant", "content": "\n\nLet me check.",
                     "reasoning": "\nThe user wants the weather.\n",
                     "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
                     "finish_reason": "tool_calls"}
    cuts = list(splits(REASONING_AND_CALL))
    for pieces in cuts[::7] + cuts[-1:]:
        assert without_ids(joined(streamed(pieces, body))) == whole, pieces


def test_a_malformed_call_is_content_and_the_reply_ends_with_stop():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
    choice = reply([text], _body(tools=TOOLS, chat_template_kwargs={"enable_thinking": False}))
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning"] is None


def test_named_tool_choice_streams_its_arguments_as_they_come():
    body = _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 chat_template_kwargs={"enable_thinking": False})
    pieces = ['{"ci', 'ty": "Pa', 'ris"}']
    choice = reply(pieces, body)
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"  # OpenAI's for a named call
    chunks = streamed(pieces, body)
    calls = [t for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [t["function"]["arguments"] for t in calls[1:]] == pieces
    assert without_ids(joined(chunks)) == comparable(choice)


def test_required_tool_choice_reads_the_array_of_calls():
    body = _body(tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": False})
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    choice = reply([text], body)
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "get_time", "arguments": "{}"}]
    assert choice["finish_reason"] == "tool_calls"
    for pieces in list(splits(text))[::5]:
        assert without_ids(joined(streamed(pieces, body))) == comparable(choice)
    # parallel_tool_calls=false: the grammar allows one call
    handler, engine = _handler([text])
    asyncio.run(handler.create(body.model_copy(update={"parallel_tool_calls": False})))
    assert engine.input.seen["params"].structured_outputs.json["maxItems"] == 1


def test_forced_calls_set_the_grammar_and_tools_reach_the_template():
    handler, engine = _handler(['{"city": "Paris"}'])
    body = _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    asyncio.run(handler.create(body))
    assert engine.input.seen["tools"] == TOOLS
    so = engine.input.seen["params"].structured_outputs  # after the reasoning: a Lark grammar around the schema
    assert so.grammar is not None and '"required": ["city"]' in so.grammar and "think" in so.grammar


def test_include_reasoning_false_and_no_parsers():
    choice = reply(["<think>hm</think>Hi"], _body(include_reasoning=False))
    assert choice["message"]["reasoning"] is None and choice["message"]["content"] == "Hi"
    plain = reply(["<think>hm</think>Hi"], _body(), reasoning=None, auto=False)
    assert plain["message"] == {"role": "assistant", "content": "<think>hm</think>Hi"}


@pytest.mark.parametrize("body,match", [
    ({"tools": []}, "must not be an empty array"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not match any"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "not both"),
])
def test_bad_tool_requests(body, match):
    handler, _ = _handler(["x"])
    with pytest.raises(ErrorResponse, match=match):
        asyncio.run(handler.create(_body(**body)))


def test_auto_needs_the_server_flag():
    handler, _ = _handler(["x"], auto=False)
    with pytest.raises(ErrorResponse, match='"auto" tool choice requires --enable-auto-tool-choice'):
        asyncio.run(handler.create(_body(tools=TOOLS)))
    reply(["x"], _body(tools=TOOLS, tool_choice="none"), auto=False)  # "none" is fine


HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.mark.parametrize("auto", [True, False])
def test_harmony_keeps_special_tokens_and_reads_reasoning_and_calls(auto):
    """gpt-oss: the harmony parsers read the special tokens, so the text keeps them (even without
    tool parsing: the reasoning parser needs them too)."""
    handler, engine = _handler([HARMONY_CALL], reasoning="openai_gptoss", auto=auto, tool_parser="openai")
    choice = asyncio.run(handler.create(_body(tools=TOOLS) if auto else _body()))["choices"][0]
    assert engine.params.skip_special_tokens is False
    assert choice["message"]["reasoning_content"] == "Need the weather tool."
    if auto:
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        assert choice["finish_reason"] == "tool_calls"
