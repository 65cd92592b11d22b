"""The tool-call parsers on hand-written outputs in each family's format: the calls and content
extracted from the whole text, and the same from the text streamed in pieces cut anywhere;
malformed calls stay content."""
from __future__ import annotations

import json

import pytest

from moe.entrypoints.parsers import TOOL_PARSERS, ToolCall
from tests.parsers.helpers import splits, stream_tools

TC, ETC = "<tool_call>", "</tool_call>"
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


def args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


CASES = [
    # --- hermes (Qwen3) ---
    ("hermes", "I'll check both cities.\n\n" + TC + '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n' + ETC + "\n" + TC + '\n{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n' + ETC,
     "I'll check both cities.", [ToolCall("get_weather", args(city="Paris", unit="celsius")),
                                 ToolCall("get_weather", args(city="Tōkyō"))]),
    ("hermes", TC + '\n{"name": "get_time", "arguments": {}}\n' + ETC, None, [ToolCall("get_time", "{}")]),
    ("hermes", "The capital of France is Paris.\n", "The capital of France is Paris.\n", []),
    ("hermes", "Wrap calls in <tool> tags, or <tool_ and so on.", "Wrap calls in <tool> tags, or <tool_ and so on.",
     []),
    # a missing closing brace: the block stays content, markers and all
    ("hermes", "Sure. " + TC + '\n{"name": "get_weather", "arguments": {"city": "Paris"}\n' + ETC,
     "Sure." + TC + '\n{"name": "get_weather", "arguments": {"city": "Paris"}\n' + ETC, []),
    ("hermes", TC + '{"arguments": {"city": "Paris"}}' + ETC + " then " + TC
     + '{"name": "f", "arguments": {"x": [1, 2]}}' + ETC + "\nDone.",
     TC + '{"arguments": {"city": "Paris"}}' + ETC + "then" + "Done.", [ToolCall("f", args(x=[1, 2]))]),
    # cut by max_tokens inside a block: complete JSON is still a call, incomplete JSON content
    ("hermes", TC + '\n{"name": "f", "arguments": {"q": "x"}}', None, [ToolCall("f", args(q="x"))]),
    ("hermes", "Let me see. " + TC + '\n{"name": "f", "argu', "Let me see." + TC + '\n{"name": "f", "argu', []),
    # arguments given as a JSON string, and Llama's "parameters"
    ("hermes", TC + '{"name": "f", "arguments": "{\\"a\\": 1}"}' + ETC + TC + '{"name": "g", "parameters": {"b": 2}}'
     + ETC, None, [ToolCall("f", args(a=1)), ToolCall("g", args(b=2))]),
    # --- deepseek_v3 ---
    ("deepseek_v3", "Let me look that up." + DS_BEGIN + ds_call("get_weather", '{"city": "Paris"}') + "\n"
     + ds_call("get_time", '{"tz": "CET"}') + DS_END, "Let me look that up.",
     [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"tz": "CET"}')]),
    ("deepseek_v3", DS_BEGIN + ds_call("search", '{\n  "query": "MoE routing",\n  "top_k": 5\n}') + DS_END,
     None, [ToolCall("search", '{\n  "query": "MoE routing",\n  "top_k": 5\n}')]),
    ("deepseek_v3", DS_BEGIN + ds_call("search", '{"query": "MoE routing"') + DS_END,
     DS_BEGIN + ds_call("search", '{"query": "MoE routing"') + DS_END, []),
    ("deepseek_v3", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("deepseek_v3", DS_BEGIN + ds_call("a", "{}"), None, [ToolCall("a", "{}")]),  # the block was not closed
    # --- pythonic / llama4_pythonic ---
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz=\'CET\', fmt=None, flags=[True, False], '
     "opts={'a': 1.5, 'b': -2})]", None,
     [ToolCall("get_weather", args(city="Paris", days=3)),
      ToolCall("get_time", args(tz="CET", fmt=None, flags=[True, False], opts={"a": 1.5, "b": -2}))]),
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Paris")]<|python_end|>', None,
     [ToolCall("get_weather", args(city="Paris"))]),
    ("llama4_pythonic", "Paris is sunny today.", "Paris is sunny today.", []),
    ("llama4_pythonic", '[get_weather(city="Paris"]', '[get_weather(city="Paris"]', []),
    ("llama4_pythonic", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    # never evaluated: calls of attributes, positional or ** arguments, non-literal values stay text
    ("pythonic", "[os.system('rm -rf /')]", "[os.system('rm -rf /')]", []),
    ("pythonic", "[__import__('os').system('x')]", "[__import__('os').system('x')]", []),
    ("pythonic", "[f('x')]", "[f('x')]", []),
    ("pythonic", "[f(**kw)]", "[f(**kw)]", []),
    ("pythonic", "[f(x=open('/etc/passwd'))]", "[f(x=open('/etc/passwd'))]", []),
    ("pythonic", "[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set: not JSON
    # --- llama3_json / llama4_json ---
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [ToolCall("get_weather", args(city="Paris"))]),
    ("llama4_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', None,
     [ToolCall("a", "{}"), ToolCall("b", args(x=1))]),
    ("llama4_json", "Hello {there}", "Hello {there}", []),
    ("llama4_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama4_json", '{"name": "a", "parameters": {}} and more', '{"name": "a", "parameters": {}} and more', []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_text_and_every_way_of_streaming_it(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    assert parser.extract(text) == (content, calls)
    for pieces in splits(text):
        assert stream_tools(parser, pieces) == (content, calls), pieces


def test_content_is_streamed_before_the_output_ends():
    """Text outside calls goes out as it comes (held back only where a marker may start)."""
    state = TOOL_PARSERS["hermes"]().stream()
    assert state.feed("The weather ") == ("The weather", [])  # the space may separate text from a call
    assert state.feed("in Paris<tool") == (" in Paris", [])
    assert state.feed('_call>{"name": "f", "arguments": {}}') == ("", [])
    assert state.feed("</tool_call>") == ("", [ToolCall("f", "{}")])
    state = TOOL_PARSERS["llama4_pythonic"]().stream()
    assert state.feed("  Par") == ("  Par", [])
    assert state.feed("is") == ("is", [])


def test_registry_names_are_vllms():
    assert set(TOOL_PARSERS) == {"hermes", "deepseek_v3", "pythonic", "llama4_pythonic", "llama3_json", "llama4_json",
                                 "openai"}
