"""gpt-oss's harmony format: the `openai_gptoss` reasoning parser and the `openai` tool parser on
hand-written outputs, from the whole text and streamed in pieces cut anywhere (inside the special
tokens' text too), each alone and chained as a chat choice runs them (reasoning first, the tool
parser on the content it leaves)."""
from __future__ import annotations

import json
import re

import pytest

from moe.entrypoints.parsers import REASONING_PARSERS, TOOL_PARSERS, Delta, ToolCall
from moe.entrypoints.parsers.harmony import HarmonyReasoningParser, HarmonyToolParser
from moe.entrypoints.serve.chat_output import ChoiceOutput, tool_calls_json
from moe.entrypoints.serve.tool_choice import ToolPlan
from tests.parsers.helpers import splits, stream_reasoning, stream_tools

PROMPT = ("<|start|>system<|message|>You are ChatGPT.\nReasoning: low<|end|><|start|>developer<|message|># Tools\n"
          "namespace functions {\ntype get_weather = (_: {location: string}) => any;\n}<|end|>"
          "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant")

ANALYSIS = "<|channel|>analysis<|message|>User asks weather. Need to call tool.<|end|>"
CALL_MSG = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"location": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
TIME_MSG = ('<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz":"CET"}'
            "<|call|>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def args(**kw) -> str:
    return json.dumps(kw, ensure_ascii=False)


PARIS = ToolCall("get_weather", args(location="Paris"))
CET = ToolCall("get_time", args(tz="CET"))

# (prompt, output, reasoning, content)
REASONING_CASES = [
    (PROMPT, "<|channel|>analysis<|message|>Simple.<|end|>" + FINAL, "Simple.", "The answer is 4."),
    # the stop token <|return|> left out of the text
    (PROMPT, "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>4", "Simple.",
     "4"),
    # a call stays in the content as written, from <|start|>, for the tool parser
    (PROMPT, ANALYSIS + CALL_MSG, "User asks weather. Need to call tool.", CALL_MSG),
    # the recipient before <|channel|>, in the header the prompt opened: <|start|>assistant is written back
    (PROMPT, ' to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Paris"}', None,
     '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Paris"}'),
    # a preamble (commentary without a recipient) is content
    (PROMPT, ANALYSIS + PREAMBLE + CALL_MSG, "User asks weather. Need to call tool.",
     "Checking the weather." + CALL_MSG),
    # cut by max_tokens: in the reasoning, inside a special token's text, inside a header, in the answer
    (PROMPT, "<|channel|>analysis<|message|>User asks", "User asks", None),
    (PROMPT, "<|channel|>analysis<|message|>Hmm<|en", "Hmm<|en", None),
    (PROMPT, "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", "x", None),
    (PROMPT, "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>The ans", "x",
     "The ans"),
    (PROMPT, "<|channel|>ana", None, None),
    (PROMPT, "<|chan", None, "<|chan"),  # only text: a token is never cut
    # two analysis messages: joined as written; text kept as written, newlines and all
    (PROMPT, "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis<|message|>\nSecond."
     "<|end|><|start|>assistant<|channel|>final<|message|>\n\nDone.\n", "First.\nSecond.", "\n\nDone.\n"),
    # a message not ended before the next one starts
    (PROMPT, "<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", "a", "b"),
    (PROMPT, "<|channel|>analysis<|message|>a<|channel|>final<|message|>b", "a", "b"),
    # a constrained final answer (response_format)
    (PROMPT, '<|channel|>analysis<|message|>JSON.<|end|><|start|>assistant<|channel|>final <|constrain|>json'
     '<|message|>{"a": 1}', "JSON.", '{"a": 1}'),
    # an empty reasoning
    (PROMPT, "<|channel|>analysis<|message|><|end|>" + FINAL, None, "The answer is 4."),
    # no harmony at all: content
    (PROMPT, "Hello there", None, "Hello there"),
    (None, "<|channel|>analysis<|message|>r<|end|>" + FINAL, "r", "The answer is 4."),
    # continue_final_message: the prompt left the reply inside its final message
    (PROMPT + "<|channel|>final<|message|>The answer", " is 4.<|return|>", None, " is 4."),
    (PROMPT + "<|channel|>analysis<|message|>Let me", " see.<|end|>" + FINAL, " see.", "The answer is 4."),
]


@pytest.mark.parametrize("prompt,text,reasoning,content", REASONING_CASES)
def test_reasoning_whole_text_and_every_way_of_streaming_it(prompt, text, reasoning, content):
    parser = REASONING_PARSERS["openai_gptoss"](prompt, None)
    assert parser.extract(text) == (reasoning, content)
    for pieces in splits(text):
        assert stream_reasoning(parser, pieces) == (reasoning, content), pieces


# (tools, output, content, calls): the tool parser on the whole output (no reasoning parser), or on
# what the reasoning parser leaves
TOOL_CASES = [
    (TOOLS, ANALYSIS + CALL_MSG, None, [PARIS]),
    (TOOLS, ANALYSIS + FINAL, "The answer is 4.", []),
    # several calls; JSON re-serialised
    (TOOLS, ANALYSIS + CALL_MSG + TIME_MSG, None, [PARIS, CET]),
    (TOOLS, ANALYSIS + PREAMBLE + CALL_MSG, "Checking the weather.", [PARIS]),
    # the stop token <|call|> left out of the text
    (TOOLS, ANALYSIS + CALL_MSG.removesuffix("<|call|>"), None, [PARIS]),
    # the recipient before <|channel|>: first in the output, and after <|start|>assistant
    (TOOLS, ' to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Paris"}', None, [PARIS]),
    (TOOLS, ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
     '{"location": "Paris"}<|call|>', None, [PARIS]),
    # on the analysis channel (gpt-oss does that at times)
    (TOOLS, '<|channel|>analysis to=functions.get_time code<|message|>{"tz": "CET"}<|call|>', None,
     [ToolCall("get_time", '{"tz": "CET"}')]),
    # arguments that are not JSON: passed through as written; cut JSON likewise; no arguments: {}
    (TOOLS, ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.run_sql <|constrain|>json<|message|>"
     "SELECT * FROM t;<|call|>", None, [ToolCall("run_sql", "SELECT * FROM t;")]),
    (TOOLS, ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather json<|message|>{"location": '
     '"Par', None, [ToolCall("get_weather", '{"location": "Par')]),
    (TOOLS, "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>", None,
     [ToolCall("get_time", "{}")]),
    # a content type that is not JSON: the body as written
    (TOOLS, '<|channel|>commentary to=functions.f <|constrain|>xml<|message|>{"a":1}<|call|>', None,
     [ToolCall("f", '{"a":1}')]),
    # not ASCII, nested values
    (TOOLS, '<|channel|>commentary to=functions.get_weather<|message|>{"location":"Tōkyō","days":[1,2],'
     '"opts":{"unit":null}}', None,
     [ToolCall("get_weather", args(location="Tōkyō", days=[1, 2], opts={"unit": None}))]),
    # a header cut before <|message|>: no call
    (TOOLS, ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_wea", None, []),
    # other recipients (built-in tools) are not function calls; a bare name is one of the request's tools
    (TOOLS, '<|channel|>analysis to=browser.search code<|message|>{"query": "Paris"}<|call|>', None, []),
    (TOOLS, '<|channel|>commentary to=get_time <|constrain|>json<|message|>{"tz": "CET"}<|call|>', None, [CET]),
    (None, '<|channel|>commentary to=get_time <|constrain|>json<|message|>{"tz": "CET"}<|call|>', None, []),
    # the reasoning parser's content: text, then the call as it left it
    (TOOLS, "Checking the weather." + CALL_MSG, "Checking the weather.", [PARIS]),
    (TOOLS, '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Paris"}',
     None, [PARIS]),
    (TOOLS, "to=x is what it said", "to=x is what it said", []),
    (TOOLS, "  \n", "  \n", []),
    (TOOLS, "The answer is 4.", "The answer is 4.", []),
]


@pytest.mark.parametrize("tools,text,content,calls", TOOL_CASES)
def test_tools_whole_text_and_every_way_of_streaming_it(tools, text, content, calls):
    parser = TOOL_PARSERS["openai"](tools)
    assert parser.extract(text) == (content, calls)
    for pieces in splits(text):
        assert stream_tools(parser, pieces) == (content, calls), pieces


# ---- chained, as a chat choice runs them -------------------------------------------------------

PIPELINE_CASES = [
    (ANALYSIS + CALL_MSG, "User asks weather. Need to call tool.", None, [PARIS]),
    (ANALYSIS + CALL_MSG + TIME_MSG, "User asks weather. Need to call tool.", None, [PARIS, CET]),
    ("<|channel|>analysis<|message|>Simple.<|end|>" + FINAL, "Simple.", "The answer is 4.", []),
    (ANALYSIS + PREAMBLE + CALL_MSG.removesuffix("<|call|>"), "User asks weather. Need to call tool.",
     "Checking the weather.", [PARIS]),
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"location":"Paris"}', None, None, [PARIS]),
    # a call not ended before the answer starts
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"location": "Paris"}'
     "<|channel|>final<|message|>Done.", "User asks weather. Need to call tool.", "Done.", [PARIS]),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.run_sql<|message|>SELECT 1",
     "User asks weather. Need to call tool.", None, [ToolCall("run_sql", "SELECT 1")]),
]

_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def _choice() -> ChoiceOutput:
    parser = HarmonyToolParser(TOOLS)
    return ChoiceOutput(ToolPlan("auto", TOOLS, parser=parser, tools=TOOLS), HarmonyReasoningParser(PROMPT))


def _streamed(pieces: list[str]) -> tuple[str | None, str | None, list[ToolCall], list[str]]:
    out = _choice()
    deltas = [out.feed(p) for p in pieces] + [out.finish()]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.name is not None:
                assert piece.index not in names and piece.arguments == ""
                names[piece.index] = piece.name
            arguments[piece.index] = arguments.get(piece.index, "") + piece.arguments
    calls = [ToolCall(names[i], arguments[i]) for i in sorted(names)]
    assert sorted(names) == list(range(len(calls)))
    return ("".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None, calls, out.ids)


@pytest.mark.parametrize("text,reasoning,content,calls", PIPELINE_CASES)
def test_chained_whole_text_and_every_way_of_streaming_it(text, reasoning, content, calls):
    out = _choice()
    assert out.message(text) == (reasoning, content, calls)
    assert len(out.ids) == len(calls) and all(_ID.fullmatch(i) for i in out.ids)
    assert out.finish_reason("stop") == ("tool_calls" if calls else "stop")
    if calls:
        assert tool_calls_json(calls, out.ids)[0] == {"id": out.ids[0], "type": "function", "function": {
            "name": calls[0].name, "arguments": calls[0].arguments}}
    for pieces in splits(text):
        r, c, streamed_calls, ids = _streamed(pieces)
        assert (r, c, streamed_calls) == (reasoning, content, calls), pieces
        assert len(ids) == len(calls) and all(_ID.fullmatch(i) for i in ids)


def _cut_points(text: str) -> list[int]:
    """Every position inside or next to a special token of `text`."""
    points = set()
    for m in re.finditer(r"<\|[a-z]+\|>", text):
        points.update(range(m.start(), m.end() + 1))
    return sorted(p for p in points if 0 < p < len(text))


TWO_CALLS = ANALYSIS + PREAMBLE + CALL_MSG + TIME_MSG


@pytest.mark.parametrize("i", _cut_points(TWO_CALLS))
def test_chained_three_pieces_cut_at_the_special_tokens(i):
    """Cut in three: once at `i` (inside or next to a special token), once at every later point."""
    expected = ("User asks weather. Need to call tool.", "Checking the weather.", [PARIS, CET])
    for j in range(i + 1, len(TWO_CALLS)):
        pieces = [TWO_CALLS[:i], TWO_CALLS[i:j], TWO_CALLS[j:]]
        assert _streamed(pieces)[:3] == expected, pieces


# ---- what goes out when --------------------------------------------------------------------------

def test_reasoning_and_content_are_streamed_as_they_come():
    state = HarmonyReasoningParser(PROMPT).stream()
    assert state.feed("<|channel|>analy") == ("", "")
    assert state.feed("sis<|message|>Let") == ("Let", "")
    assert state.feed(" me<|e") == (" me", "")  # <|e may start <|end|>
    assert state.feed("nd|><|start|>assistant<|channel|>final<|message|>4") == ("", "4")
    assert state.feed(" it <") == ("", " it ")
    assert state.feed("is.<|return|>") == ("", "<is.")
    assert state.finish() == ("", "")


def test_a_call_goes_out_when_its_message_ends():
    state = HarmonyToolParser(TOOLS).stream()
    assert state.feed(ANALYSIS) == ("", [])
    assert state.feed("<|start|>assistant<|channel|>commentary<|message|>Checking") == ("Checking", [])
    assert state.feed("<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{") == ("", [])
    assert state.feed('"location": "Paris"}<|ca') == ("", [])
    assert state.feed("ll|>") == ("", [PARIS])
    state = HarmonyToolParser(TOOLS).stream()
    assert state.feed('<|channel|>commentary to=functions.get_weather<|message|>{"location": "Paris"}') == ("", [])
    assert state.finish() == ("", [PARIS])  # the stop token's text is not in the output


def test_a_plain_reply_is_streamed_at_once():
    """Output that cannot be the header the prompt opened (` to=...`) goes out as content at once."""
    state = HarmonyToolParser(TOOLS).stream()
    assert state.feed(" t") == ("", [])  # may be " to=functions...."
    assert state.feed("he answer") == (" the answer", [])
    assert state.feed(" is") == (" is", [])


def test_end_of_reasoning_and_thinking():
    """What a constraint after the reasoning is placed by: the reply starts reasoning unless the
    prompt left it inside an answer."""
    assert HarmonyReasoningParser.end == "<|channel|>final<|message|>"
    assert HarmonyReasoningParser(PROMPT).thinking
    assert HarmonyReasoningParser(None).thinking
    assert HarmonyReasoningParser(PROMPT + "<|channel|>analysis<|message|>Hm").thinking
    assert not HarmonyReasoningParser(PROMPT + "<|channel|>final<|message|>The").thinking
    text = "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant" + HarmonyReasoningParser.end + "4"
    assert HarmonyReasoningParser(PROMPT).extract(text) == ("Simple.", "4")


def test_registered_by_vllms_names():
    assert REASONING_PARSERS["openai_gptoss"] is HarmonyReasoningParser
    assert TOOL_PARSERS["openai"] is HarmonyToolParser


def test_delta_of_a_call_names_it_then_gives_its_arguments():
    out = _choice()
    deltas = [out.feed(ANALYSIS), out.feed(CALL_MSG)]
    assert deltas[0] == Delta(reasoning="User asks weather. Need to call tool.")
    assert [(p.index, p.name, p.arguments) for p in deltas[1].tool_calls] == [
        (0, "get_weather", ""), (0, None, args(location="Paris"))]
    assert deltas[1].content == "" and len(out.ids) == 1
