"""The chat-completion handler: messages (and tools) through the chat template, each choice's text
back as a message with reasoning, content and tool calls (chat_output.py), streamed or whole.

A request's constraint is its response_format / structured_outputs, or the grammar of a forced
tool call (tool_choice "required" or named); both at once are refused, as by vLLM. With a reasoning
parser, while the prompt leaves the model reasoning, the constraint applies after the reasoning
(constraints.after_reasoning). A reply carries `reasoning` (vLLM's current name) and
`reasoning_content` (its former one, DeepSeek's API) when the server has a reasoning parser.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from moe.engine.chat_template import check_messages
from moe.engine.input_processor import ProcessedPrompt, split_chat_images
from moe.entrypoints.parsers import REASONING_PARSERS, Delta, ThinkingReasoningParser
from moe.entrypoints.serve.chat_output import ChoiceOutput, tool_call_delta_json, tool_calls_json
from moe.entrypoints.serve.constraints import after_reasoning, forced_call_constraint, request_constraint
from moe.entrypoints.serve.handlers import _Choice, _Handler, _TokenNames, _finite
from moe.entrypoints.serve.protocol import ChatCompletionRequest, flatten_content
from moe.entrypoints.serve.tool_choice import ToolPlan, ToolSettings, plan_tools
from moe.outputs import CompletionOutput
from moe.sampling_params import SamplingParams

# Parsers whose markers may be special tokens in some checkpoints (Hermes models'; DeepSeek's):
# the text must keep them to be parsed, as vLLM's hermes parser asks for too.
_PARSERS_NEEDING_SPECIAL_TOKENS = ("hermes", "deepseek_v3", "openai")
# harmony (gpt-oss) marks every message, the reasoning too, with special tokens: always kept in the text
_REASONING_NEEDING_SPECIAL_TOKENS = ("openai_gptoss",)


@dataclass
class _ChatState:
    """One request's output side: its ToolPlan, reasoning parser and one ChoiceOutput per choice."""
    plan: ToolPlan
    reasoning: ThinkingReasoningParser | None
    include_reasoning: bool
    choices: dict[int, ChoiceOutput] = field(default_factory=dict)

    def output(self, index: int) -> ChoiceOutput:
        if index not in self.choices:
            self.choices[index] = ChoiceOutput(self.plan, self.reasoning, self.include_reasoning)
        return self.choices[index]

    @property
    def parsing(self) -> bool:
        return self.reasoning is not None or self.plan.mode != "none"


class ChatHandler(_Handler):
    object_name, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    prompt_what = "the messages"

    def __init__(self, engine, model_name: str, tools: ToolSettings | None = None,
                 reasoning_parser: str | None = None) -> None:
        super().__init__(engine, model_name)
        self.tools = tools or ToolSettings()
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        self.reasoning_parser = reasoning_parser

    def _prepare(self, body: ChatCompletionRequest):
        if not body.messages:
            raise ValueError("messages is required: a non-empty list of {'role': ..., 'content': ...}")
        plan = plan_tools(body, self.tools)
        forced = plan.constraint()
        if forced is None:
            constraint = request_constraint(body.structured_outputs, body.response_format)
        else:
            constraint = forced_call_constraint(forced, body.structured_outputs, body.response_format)
        check_messages(body.messages)  # before flatten_content, which keeps only the text parts
        messages = flatten_content(body.messages)
        kwargs = body.chat_template_kwargs or {}
        if body.continue_final_message:
            prompt = self._continue_final(messages, body.generation_prompt(), body.chat_template, plan.template_tools,
                                          kwargs)
        else:
            prompt = self.engine.input.process_chat(messages, body.generation_prompt(), body.chat_template,
                                                    plan.template_tools, **kwargs)
        asked = body.requested_max_tokens()
        params = body.sampling_params(None if asked is None else asked[1], body.chat_logprobs(),
                                      structured_outputs=constraint)
        if (plan.mode == "auto" and self.tools.tool_call_parser in _PARSERS_NEEDING_SPECIAL_TOKENS) or \
                self.reasoning_parser in _REASONING_NEEDING_SPECIAL_TOKENS:
            params = params.clone(skip_special_tokens=False)
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = REASONING_PARSERS[self.reasoning_parser](prompt.prompt, kwargs)
        state = _ChatState(plan, reasoning, body.include_reasoning)
        # cut after rendering, as LLM.chat's: the rendered prompt must fit max_model_len
        return [self.engine.input.truncate(prompt, params.truncate_prompt_tokens)], params, state

    def _checked(self, body, prompts, params: SamplingParams, state: _ChatState) -> SamplingParams:
        """A constraint checked as the client gave it is, for a model that reasons first, moved
        after its reasoning (and that grammar checked in turn)."""
        if params.structured_outputs is None or state.reasoning is None or not state.reasoning.thinking:
            return params
        params = params.clone(structured_outputs=after_reasoning(params.structured_outputs, state.reasoning.end))
        self.engine.input.check_params(params)
        return params

    def _continue_final(self, messages: list[dict], add_generation_prompt: bool, template: str | None,
                        tools: list[dict] | None, kwargs: dict) -> ProcessedPrompt:
        """The conversation rendered so that it ends inside the last message (the model continues
        it): a marker appended to that message's content shows where its text ends."""
        if add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        messages, images = split_chat_images(messages)
        content = messages[-1].get("content")
        if not isinstance(content, str):
            raise ValueError("continue_final_message: the last message needs a text content to continue")
        marker = f"<moe-continue-{uuid.uuid4().hex}>"
        marked = [*messages[:-1], {**messages[-1], "content": content + marker}]
        text = self.engine.input.render_chat(marked, False, template, tools, **kwargs)
        if text.count(marker) != 1:
            raise ValueError("continue_final_message: the chat template does not render the last message's "
                             "content as given, so there is no end of it to continue from")
        text = text[:text.index(marker)]
        tok = self.engine.input.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer: this model folder has no tokenizer.json")
        # The template writes the special tokens itself, as for any chat prompt.
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return self.engine.input.process_prompt(prompt)

    @staticmethod
    def _echo(body: ChatCompletionRequest) -> str:
        """With echo: the last message's content when the reply continues that role (vLLM's rule)."""
        if not body.echo or not body.messages:
            return ""
        last = flatten_content(body.messages[-1:])[0]
        if last.get("role") != body.response_role():
            return ""
        return last.get("content") or ""

    def _logprobs(self, body, token_ids: list[int], entries: list) -> dict | None:
        if not body.logprobs:
            return None
        names = _TokenNames(self.engine.info.tokenizer)

        def item(tid, lp):
            return {"token": names.text(tid), "logprob": _finite(lp.logprob), "bytes": list(names.bytes(tid))}

        content = []
        for tid, entry in zip(token_ids, entries):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:body.top_logprobs or 0]
            content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in ranked]})
        return {"content": content}

    def _choice(self, body, index: int, c: _Choice, prompt: ProcessedPrompt, prompt_logprobs: list | None = None,
                state: _ChatState | None = None) -> dict:
        echo = self._echo(body)
        message = {"role": body.response_role(), "content": echo + c.text}
        finish_reason = c.finish_reason
        if state is not None and state.parsing:
            out = state.output(index)
            reasoning, content, calls = out.message(c.text)
            message["content"] = (echo + (content or "")) or None
            if state.reasoning is not None:
                message["reasoning"] = message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = tool_calls_json(calls, out.ids)
            finish_reason = out.finish_reason(c.finish_reason)
        return {"index": index, "message": message, "logprobs": self._logprobs(body, c.token_ids, c.logprobs),
                "finish_reason": finish_reason, "stop_reason": c.stop_reason}

    def _chunks(self, body, index: int, o: CompletionOutput, prompt: ProcessedPrompt, first: bool,
                prompt_logprobs: list | None = None, state: _ChatState | None = None) -> list[dict]:
        """This output's chunks: its text through the choice's parsers; each tool-call piece in a
        chunk of its own, the first after any text, the logprobs on the first chunk and the
        finish_reason on the last. Nothing while the parsers hold all of its text back."""
        finish_reason = o.finish_reason
        parsing = state is not None and state.parsing
        if parsing:
            out = state.output(index)
            delta = out.feed(o.text)
            if o.finish_reason is not None:
                held = out.finish()
                delta = Delta(delta.reasoning + held.reasoning, delta.content + held.content,
                              delta.tool_calls + held.tool_calls)
                finish_reason = out.finish_reason(o.finish_reason)
            ids = out.ids
        else:
            delta, ids = Delta(content=o.text), []
        logprobs = self._logprobs(body, o.token_ids, o.logprobs or [])
        if not (first or delta or logprobs or finish_reason is not None or not o.text):
            return []
        text: dict = {}
        if first:
            text = {"role": body.response_role(), "content": self._echo(body) + delta.content}
        elif delta.content or not parsing:
            text["content"] = delta.content
        if delta.reasoning:
            text["reasoning"] = text["reasoning_content"] = delta.reasoning
        deltas = [text]
        for piece in delta.tool_calls:
            call = [tool_call_delta_json(piece, ids)]
            if len(deltas) == 1 and "tool_calls" not in deltas[0]:  # the first piece joins the text
                deltas[0]["tool_calls"] = call
            else:
                deltas.append({"tool_calls": call})
        chunks = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None, "stop_reason": None}
                  for d in deltas]
        chunks[0]["logprobs"] = logprobs
        chunks[-1].update(finish_reason=finish_reason, stop_reason=o.stop_reason)
        return chunks
