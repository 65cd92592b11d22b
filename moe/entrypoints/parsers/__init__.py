"""Parsers of a chat reply's text, by vLLM's names: reasoning (`--reasoning-parser`, reasoning.py;
gpt-oss's in harmony.py) and tool calls (`--tool-call-parser`: hermes.py, deepseek_v3.py,
pythonic.py, llama_json.py, on the bases of tool_parser.py; gpt-oss's in harmony.py). Each has a
whole-text `extract` and a `stream()` state fed the text as it is generated."""
from __future__ import annotations

from moe.entrypoints.parsers.deepseek_v3 import DeepSeekV3ToolParser
from moe.entrypoints.parsers.harmony import HarmonyToolParser
from moe.entrypoints.parsers.hermes import HermesToolParser
from moe.entrypoints.parsers.llama_json import Llama3JsonToolParser, Llama4JsonToolParser
from moe.entrypoints.parsers.output import Delta, ToolCall, ToolCallDelta
from moe.entrypoints.parsers.pythonic import Llama4PythonicToolParser, PythonicToolParser
from moe.entrypoints.parsers.reasoning import REASONING_PARSERS, ThinkingReasoningParser
from moe.entrypoints.parsers.tool_parser import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, DeepSeekV3ToolParser, PythonicToolParser, Llama4PythonicToolParser, Llama3JsonToolParser,
    Llama4JsonToolParser, HarmonyToolParser)}

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "Delta", "ThinkingReasoningParser", "ToolCall", "ToolCallDelta",
           "ToolParser"]
