"""The reasoning parsers on hand-written outputs: reasoning and content from the whole text and
from the text streamed in pieces cut anywhere, with the prompt and chat_template_kwargs deciding
whether the output starts inside the reasoning."""
from __future__ import annotations

import pytest

from moe.entrypoints.parsers import REASONING_PARSERS
from tests.parsers.helpers import splits, stream_reasoning

QWEN_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
R1_PROMPT = "<｜User｜>What is 2+2?<｜Assistant｜><think>\n"
NO_THINK_PROMPT = QWEN_PROMPT + "<think>\n\n</think>\n\n"

CASES = [
    ("qwen3", QWEN_PROMPT, None, "<think>\nThe user asks for 2+2, which is 4.\n</think>\n\nIt is 4.",
     "\nThe user asks for 2+2, which is 4.\n", "\n\nIt is 4."),
    # the template opened it: no <think> in the output
    ("deepseek_r1", R1_PROMPT, None, "Okay, 2 + 2 = 4.\n</think>\n\nThe answer is **4**.", "Okay, 2 + 2 = 4.\n",
     "\n\nThe answer is **4**."),
    ("deepseek_r1", R1_PROMPT, None, "  <think>Hmm</think>4", "Hmm", "4"),
    # cut before the end of the reasoning: all of it is reasoning
    ("deepseek_r1", R1_PROMPT, None, "Let me think about </thi", "Let me think about </thi", None),
    ("qwen3", QWEN_PROMPT, None, "<think>\nstill thinking", "\nstill thinking", None),
    ("qwen3", QWEN_PROMPT, None, "<thin", "<thin", None),
    # only the first </think> ends the reasoning
    ("qwen3", QWEN_PROMPT, None, "a</think>b </think> c", "a", "b </think> c"),
    ("qwen3", QWEN_PROMPT, None, "<think></think>", None, None),
    # reasoning turned off: everything is content
    ("qwen3", NO_THINK_PROMPT, None, "It is 4.", None, "It is 4."),
    ("qwen3", QWEN_PROMPT, {"enable_thinking": False}, "<think>x</think>It is 4.", None, "<think>x</think>It is 4."),
    ("deepseek_r1", R1_PROMPT + "\n\n</think>\n\n", None, "4", None, "4"),
]


@pytest.mark.parametrize("name,prompt,kwargs,text,reasoning,content", CASES)
def test_whole_text_and_every_way_of_streaming_it(name, prompt, kwargs, text, reasoning, content):
    parser = REASONING_PARSERS[name](prompt, kwargs)
    assert parser.extract(text) == (reasoning, content)
    for pieces in splits(text):
        assert stream_reasoning(parser, pieces) == (reasoning, content), pieces


def test_reasoning_is_streamed_as_it_comes():
    state = REASONING_PARSERS["deepseek_r1"](R1_PROMPT).stream()
    assert state.feed("First, ") == ("First, ", "")
    assert state.feed("add.</th") == ("add.", "")
    assert state.feed("ink>\n\n4") == ("", "\n\n4")
    assert state.feed(" is it") == ("", " is it")
