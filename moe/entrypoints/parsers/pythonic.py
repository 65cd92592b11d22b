"""`pythonic` / `llama4_pythonic`: calls as a Python list of function calls with keyword arguments,
as Llama-4 writes them: `[get_weather(city="Paris", days=3), get_time(tz="CET")]`, for Llama-4
between `<|python_start|>` and `<|python_end|>`. Read with Python's ast (literal values only:
strings, numbers, booleans, None, lists, dicts), never evaluated."""
from __future__ import annotations

import ast
import json

from moe.entrypoints.parsers.output import ToolCall
from moe.entrypoints.parsers.tool_parser import WholeOutputToolParser

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise ValueError("not a call by name with keyword arguments")
    arguments = {}
    for kw in node.keywords:
        if kw.arg is None:  # f(**x)
            raise ValueError("** arguments")
        arguments[kw.arg] = ast.literal_eval(kw.value)
    # allow_nan=False: 1e999 is inf, which JSON cannot hold; sets and bytes fail as TypeError
    return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))


class PythonicToolParser(WholeOutputToolParser):
    name = "pythonic"
    prefixes = (PYTHON_START,)
    openers = ("[",)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START):]
        body = body.replace(PYTHON_END, "").strip()
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List):
                return None
            return [_call(node) for node in tree.elts] or None
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return None


class Llama4PythonicToolParser(PythonicToolParser):
    name = "llama4_pythonic"
