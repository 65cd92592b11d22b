"""Tool-call arguments of a conversation, as chat templates read them.

OpenAI's messages carry an assistant's `tool_calls[i].function.arguments` as JSON text.
Templates disagree on what they get: Hugging Face's convention (and vLLM's, which turns the text
into a dict before rendering) is a dict, `{{ arguments | tojson }}` or `{% for k, v in
arguments.items() %}`; DeepSeek-V3's template concatenates the text, `'```json\\n' + arguments`; Qwen3's
takes either (`arguments is string`). `ToolArguments` serves all of them: a dict of the parsed
object that, printed or joined to text with `+` or `~`, is the text the client sent.

This runs where the template renders (the renderer process under `moe serve`), so the messages
cross to it as plain JSON.
"""
from __future__ import annotations

import json


class ToolArguments(dict):
    def __init__(self, value: dict, text: str) -> None:
        super().__init__(value)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __add__(self, other):
        return self.text + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + self.text if isinstance(other, str) else NotImplemented


def _arguments(value):
    if value is None or value == "":
        return ToolArguments({}, "{}")
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value  # not JSON: the template gets the text as it is
        return ToolArguments(parsed, value) if isinstance(parsed, dict) else value
    return value


def _call(call):
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if isinstance(function, dict) and "arguments" in function:
        return {**call, "function": {**function, "arguments": _arguments(function["arguments"])}}
    if "arguments" in call:  # the flat form some clients send
        return {**call, "arguments": _arguments(call["arguments"])}
    return call


def with_tool_arguments(context: dict) -> dict:
    """The render context with each assistant tool call's arguments as ToolArguments (copies: the
    caller's messages are not changed)."""
    messages = context.get("messages")
    if not isinstance(messages, list):
        return context
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list):
            m = {**m, "tool_calls": [_call(c) for c in calls]}
        out.append(m)
    return {**context, "messages": out}
