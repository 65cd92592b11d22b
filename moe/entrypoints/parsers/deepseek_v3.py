"""`deepseek_v3`: DeepSeek-V3's calls, as its chat template renders them, all in one block:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The arguments are returned as the model wrote them (they must be a JSON object)."""
from __future__ import annotations

import json
import re

from moe.entrypoints.parsers.output import ToolCall
from moe.entrypoints.parsers.tool_parser import BlockToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(?P<type>[^<]*?)<｜tool▁sep｜>(?P<name>[^\n<]+?)\s*\n"
                   r"```(?:json)?\s*\n(?P<arguments>.*?)\n?\s*```\s*<｜tool▁call▁end｜>\s*", re.DOTALL)


class DeepSeekV3ToolParser(BlockToolParser):
    name = "deepseek_v3"
    start = CALLS_BEGIN
    end = CALLS_END

    def parse_block(self, block: str) -> list[ToolCall] | None:
        calls, pos = [], 0
        while pos < len(block):
            m = _CALL.match(block, pos)
            if m is None or m.group("type").strip() != "function":
                return None
            arguments = m.group("arguments").strip()
            try:
                if not isinstance(json.loads(arguments), dict):
                    return None
            except ValueError:
                return None
            calls.append(ToolCall(m.group("name").strip(), arguments))
            pos = m.end()
        return calls or None
