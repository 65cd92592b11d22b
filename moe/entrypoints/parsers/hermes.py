"""`hermes`: Hermes-style calls, as Qwen3 writes them (its chat template asks for them):
`<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`, one block per
call, after or between free text."""
from __future__ import annotations

import json

from moe.entrypoints.parsers.output import ToolCall
from moe.entrypoints.parsers.tool_parser import BlockToolParser


def json_object_text(value) -> str | None:
    """A call's arguments as JSON text: a dict, or a string holding a JSON object; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj) -> ToolCall | None:
    """{"name": ..., "arguments" (or Llama's "parameters"): {...}} as a ToolCall; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    text = json_object_text(arguments)
    return None if text is None else ToolCall(obj["name"], text)


class HermesToolParser(BlockToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_block(self, block: str) -> list[ToolCall] | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        call = call_from_object(obj)
        return None if call is None else [call]
