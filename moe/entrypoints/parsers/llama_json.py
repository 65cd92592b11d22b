"""`llama3_json` / `llama4_json`: calls as JSON objects, as Llama 3.x and 4 write them with a JSON
tool-call template: `{"name": "get_weather", "parameters": {"city": "Paris"}}` (or "arguments"),
several separated by `;`, the first optionally after `<|python_tag|>`. The output is either the
calls or plain content."""
from __future__ import annotations

import json

from moe.entrypoints.parsers.hermes import call_from_object
from moe.entrypoints.parsers.output import ToolCall
from moe.entrypoints.parsers.tool_parser import WholeOutputToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(WholeOutputToolParser):
    name = "llama3_json"
    prefixes = (PYTHON_TAG,)
    openers = ("{",)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return None
            call = call_from_object(obj)
            if call is None:
                return None
            calls.append(call)
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            pos = len(body) - len(rest)
        return calls or None


class Llama4JsonToolParser(Llama3JsonToolParser):
    name = "llama4_json"
