"""Structured outputs, tool calls and reasoning through `moe serve` with the real `openai` client:
one server on the tiny model stripped of its chat template, given a Qwen3-style one with
--chat-template, with --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3.

The model has random weights: its output is schema-valid JSON, a call with valid arguments or a
hermes tool-call block only when the grammar makes it so (the engine's structured outputs); the
tests that need the model to end its own reasoning turn the reasoning off (enable_thinking false)."""
from __future__ import annotations

import json
import os
import re
import shutil

import httpx
import openai
import pytest

from tests.serve.helpers import API_KEY, MODEL_NAME, ServerProcess, headers

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates", "qwen3.jinja")
COMPACT = {"disable_any_whitespace": True}  # a random model would write whitespace for ever
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
COMPACT_NO_THINKING = {**NO_THINKING, "structured_outputs": COMPACT}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


def check_weather(args: dict) -> None:
    assert set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 10
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 9


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """The tiny model without a chat template: the server has --chat-template's only."""
    from models.tiny import ensure_tiny_model

    folder = str(tmp_path_factory.mktemp("bare"))
    shutil.copytree(ensure_tiny_model("tiny-qwen3-moe"), folder, dirs_exist_ok=True)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return folder


@pytest.fixture(scope="module")
def server(bare_model, tmp_path_factory):
    # The tools' system turn is long in the tiny byte-level vocabulary: room for it.
    srv = ServerProcess(bare_model, str(tmp_path_factory.mktemp("log") / "serve.log"), extra=[
        "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--max-model-len", "2048"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=120.0, max_retries=0)


def chat(client, **kw):
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL_NAME, **kw)


def stream(client, **kw) -> dict:
    """A streamed reply put together from its deltas: content, reasoning, tool calls, finish_reason."""
    out = {"content": "", "reasoning": "", "calls": [], "finish_reason": None}
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            out["content"] += d.content or ""
            out["reasoning"] += getattr(d, "reasoning", None) or ""
            for t in d.tool_calls or []:
                if t.id is not None:
                    assert t.type == "function" and t.index == len(out["calls"]) and t.id.startswith("chatcmpl-tool-")
                    out["calls"].append({"name": t.function.name, "arguments": ""})
                out["calls"][t.index]["arguments"] += t.function.arguments or ""
            out["finish_reason"] = c.finish_reason or out["finish_reason"]
    return out


# ---- structured outputs -----------------------------------------------------------------------

def test_json_schema_response_format_whole_and_streamed(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = chat(client, response_format=fmt, extra_body=COMPACT_NO_THINKING)
    check_weather(json.loads(r.choices[0].message.content))
    assert r.choices[0].finish_reason == "stop"
    s = stream(client, response_format=fmt, extra_body=COMPACT_NO_THINKING)
    assert s["content"] == r.choices[0].message.content and s["finish_reason"] == "stop"


def test_json_object_and_vllm_structured_outputs_on_chat_and_completions(client):
    r = chat(client, response_format={"type": "json_object"}, max_tokens=60, extra_body=COMPACT_NO_THINKING)
    if r.choices[0].finish_reason == "stop":  # a random model may go on inside one string
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = chat(client, extra_body={**NO_THINKING, "structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert r.choices[0].message.content in ("sunny", "rainy")
    c = client.completions.create(model=MODEL_NAME, prompt="Code:", max_tokens=20, temperature=0.0,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", c.choices[0].text)
    c = client.completions.create(model=MODEL_NAME, prompt="Weather:", max_tokens=80, temperature=0.0,
                                  extra_body={"structured_outputs": COMPACT, "response_format": {
                                      "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}})
    check_weather(json.loads(c.choices[0].text))


@pytest.mark.parametrize("extra, names", [
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_it(server, client, extra, names):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={**NO_THINKING, **extra})
    assert names in e.value.body["message"] and e.value.status_code == 400
    assert chat(client, max_tokens=3, extra_body=NO_THINKING).choices[0].message.content is not None


# ---- tools --------------------------------------------------------------------------------------

def test_named_tool_choice_calls_with_schema_valid_arguments(client):
    kw = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "extra_body": COMPACT_NO_THINKING}
    r = chat(client, **kw)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    check_weather(json.loads(call.function.arguments))
    assert choice.finish_reason == "stop" and not choice.message.content
    s = stream(client, **kw)
    assert s["calls"] == [{"name": "get_weather", "arguments": call.function.arguments}]


def test_required_tool_choice_calls_one_of_the_tools(client):
    r = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=120,
             extra_body=COMPACT_NO_THINKING)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    check_weather(args) if call.function.name == "get_weather" else None
    assert choice.finish_reason == "tool_calls"


CALL_TEXT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             "</tool_call>")


def test_auto_tool_choice_parses_the_models_hermes_call(client):
    """The grammar writes a hermes block (a random model would not): the server's parser turns it
    into an OpenAI tool call, whole and streamed."""
    kw = {"tools": TOOLS, "max_tokens": 200,
          "extra_body": {**NO_THINKING, "structured_outputs": {"choice": [CALL_TEXT]}}}
    choice = chat(client, **kw).choices[0]
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    s = stream(client, **kw)
    assert s["content"] == "Checking." and s["finish_reason"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"]] == [("get_weather", {"city": "Paris",
                                                                                             "days": 2})]
    # "none": the same text stays content
    choice = chat(client, **{**kw, "tool_choice": "none"}).choices[0]
    assert choice.message.content == CALL_TEXT and not choice.message.tool_calls


def test_tool_turns_go_through_the_template(server, client):
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"}]
    r = httpx.post(f"{server.url}/tokenize", headers=headers(), timeout=30,
                   json={"model": MODEL_NAME, "messages": history, "tools": TOOLS})
    text = httpx.post(f"{server.url}/detokenize", headers=headers(), timeout=30,
                      json={"model": MODEL_NAME, "tokens": r.json()["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in text
    assert chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=3).choices[0].finish_reason


# ---- reasoning ----------------------------------------------------------------------------------

def test_reasoning_goes_to_reasoning_and_thinking_off_to_content(client):
    r = chat(client, max_tokens=12)
    m = r.choices[0].message
    # the random model never closes its reasoning: all of it is reasoning, as a cut-off reply's is
    assert m.reasoning and m.reasoning == m.reasoning_content and m.content is None
    s = stream(client, max_tokens=12)
    assert s["reasoning"] == m.reasoning and s["content"] == ""
    r = chat(client, max_tokens=12, extra_body=NO_THINKING)
    assert r.choices[0].message.content and r.choices[0].message.reasoning is None


def test_structured_outputs_after_the_reasoning(client):
    """With the reasoning on, the schema applies after `</think>`: whatever the model gets to,
    content is schema-valid JSON (the grammar's split is the parser's)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    m = chat(client, response_format=fmt, max_tokens=40, extra_body={"structured_outputs": COMPACT})
    m = m.choices[0].message
    assert m.reasoning is not None
    if m.content is not None:
        check_weather(json.loads(m.content))


def test_serve_flags_that_do_not_go_together_stop_it_at_start(capsys):
    from moe.entrypoints.cli import main

    assert main(["serve", "tiny-qwen3-moe", "--enable-auto-tool-choice"]) == 1
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "tiny-qwen3-moe", "--chat-template", "/no/such/template.jinja"]) == 1
    assert "no such file" in capsys.readouterr().err
