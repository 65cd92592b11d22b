"""Feeding a parser's stream the text cut in pieces: at every split point into two pieces, and
one character at a time; what the pieces give joined must equal the whole-text result."""
from __future__ import annotations


def splits(text: str):
    """Each way of cutting `text` tested: whole, two pieces at every position, character by character."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def stream_tools(parser, pieces: list[str]):
    """(content or None, calls) of a tool parser's stream fed `pieces`."""
    state = parser.stream()
    content, calls = [], []
    for piece in pieces:
        text, new = state.feed(piece)
        content.append(text)
        calls += new
    text, new = state.finish()
    return "".join(content + [text]) or None, calls + new


def stream_reasoning(parser, pieces: list[str]):
    """(reasoning or None, content or None) of a reasoning parser's stream fed `pieces`."""
    state = parser.stream()
    reasoning, content = [], []
    for piece in pieces:
        r, c = state.feed(piece)
        reasoning.append(r)
        content.append(c)
    r, c = state.finish()
    return "".join(reasoning + [r]) or None, "".join(content + [c]) or None
