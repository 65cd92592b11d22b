"""One chat choice's generated text as an OpenAI message: reasoning (the server's reasoning
parser), then, in what follows it, tool calls by the request's ToolPlan, and the content left.
The same steps run on the whole text (a response) and piece by piece (a stream), and give the
same message.

Tool calls are numbered in order and get ids `chatcmpl-tool-<hex>` (vLLM's form). Streamed, a
call's first piece names it (`index`, `id`, `type`, `function.name`, arguments ""), the later ones
carry its arguments: a named call's as they are generated, a parsed call's once it is complete.
"""
from __future__ import annotations

import json
import uuid

from moe.entrypoints.parsers import Delta, ThinkingReasoningParser, ToolCall, ToolCallDelta
from moe.entrypoints.serve.tool_choice import ToolPlan


class JsonArrayItems:
    """The top-level objects of a JSON array fed as text in pieces, each as its text once it
    closes (a `"required"` tool choice's output: the grammar makes it an array of objects)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False
        self.item: list[str] = []  # the open item's characters

    def feed(self, text: str) -> list[str]:
        done = []
        for ch in text:
            if self.depth >= 2:
                self.item.append(ch)
                if self.in_string:
                    if self.escaped:
                        self.escaped = False
                    elif ch == "\\":
                        self.escaped = True
                    elif ch == '"':
                        self.in_string = False
                    continue
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.depth += 1
                elif ch in "}]":
                    self.depth -= 1
                    if self.depth == 1:
                        done.append("".join(self.item))
                        self.item = []
            elif ch == "[" and self.depth == 0:
                self.depth = 1
            elif ch == "{" and self.depth == 1:
                self.depth, self.item = 2, ["{"]
            elif ch == "]" and self.depth == 1:
                self.depth = -1  # the array is closed: whatever follows is not an item
        return done

    def leftover(self) -> str:
        """An item still open at the end (the output was cut), as text."""
        return "".join(self.item)


def _required_call(item: str) -> ToolCall | None:
    try:
        obj = json.loads(item)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("parameters"), dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))


class ChoiceOutput:
    def __init__(self, plan: ToolPlan, reasoning: ThinkingReasoningParser | None = None,
                 include_reasoning: bool = True) -> None:
        self.plan = plan
        self.reasoning_parser = reasoning
        self.include_reasoning = include_reasoning
        self.ids: list[str] = []  # tool call ids by index
        self._reasoning = reasoning.stream() if reasoning is not None else None
        self._tools = plan.parser.stream() if plan.mode == "auto" else None
        self._items = JsonArrayItems() if plan.mode == "required" else None
        self._named_started = False

    # ---- a stream -------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._after_reasoning(reasoning, content, final=False)

    def finish(self) -> Delta:
        """What the parsers held back, at the end of the choice."""
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        return self._after_reasoning(reasoning, content, final=True)

    def _after_reasoning(self, reasoning: str, content: str, final: bool) -> Delta:
        delta = Delta(reasoning=reasoning if self.include_reasoning else "")
        mode = self.plan.mode
        if mode == "auto":
            text, calls = self._tools.feed(content)
            if final:
                more_text, more_calls = self._tools.finish()
                text, calls = text + more_text, calls + more_calls
            delta.content = text
            for call in calls:
                self._add_call(delta, call)
        elif mode == "named":
            if content:
                if not self._named_started:
                    self._named_started = True
                    delta.tool_calls.append(ToolCallDelta(0, self.plan.name, ""))
                    self.ids.append(_new_id())
                delta.tool_calls.append(ToolCallDelta(0, None, content))
        elif mode == "required":
            for item in self._items.feed(content):
                call = _required_call(item)
                if call is None:
                    delta.content += item
                else:
                    self._add_call(delta, call)
            if final:
                delta.content += self._items.leftover()
        else:
            delta.content = content
        return delta

    def _add_call(self, delta: Delta, call: ToolCall) -> None:
        if not self.plan.parallel and self.ids:
            return  # parallel_tool_calls=false: the first call only (vLLM drops the others too)
        index = len(self.ids)
        self.ids.append(_new_id())
        delta.tool_calls += [ToolCallDelta(index, call.name, ""), ToolCallDelta(index, None, call.arguments)]

    # ---- a whole text ---------------------------------------------------------------------
    def message(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(reasoning, content, tool calls) of a choice's whole text."""
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract(text)
        else:
            reasoning, content = None, text
        if not self.include_reasoning:
            reasoning = None
        content = content or ""
        mode = self.plan.mode
        calls: list[ToolCall] = []
        if mode == "auto":
            content, calls = self.plan.parser.extract(content)
        elif mode == "named":
            calls, content = ([ToolCall(self.plan.name, content)] if content else []), None
        elif mode == "required":
            items = JsonArrayItems()
            rest = []
            for item in items.feed(content):
                call = _required_call(item)
                if call is None:
                    rest.append(item)
                else:
                    calls.append(call)
            content = "".join(rest) + items.leftover()
        if not self.plan.parallel:
            calls = calls[:1]
        self.ids = [_new_id() for _ in calls]
        return reasoning, content or None, calls

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when an "auto" or "required" choice called and stopped on its own;
        a named call ends with "stop"."""
        if engine_reason == "stop" and self.ids and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return engine_reason


def _new_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_calls_json(calls: list[ToolCall], ids: list[str]) -> list[dict]:
    return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c, i in zip(calls, ids)]


def tool_call_delta_json(piece: ToolCallDelta, ids: list[str]) -> dict:
    if piece.name is not None:
        return {"index": piece.index, "id": ids[piece.index], "type": "function",
                "function": {"name": piece.name, "arguments": piece.arguments}}
    return {"index": piece.index, "function": {"arguments": piece.arguments}}
