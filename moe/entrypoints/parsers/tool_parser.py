"""The two shapes of tool-call output, as bases for the parsers of each model family
(`--tool-call-parser NAME`). Each parser has a whole-text `extract(text) -> (content, calls)` and
a `stream()` state fed the generated text piece by piece, whose `feed` / `finish` return the
content of that piece and the calls completed in it; the pieces joined equal `extract`'s answer
for any way of cutting the text.

* Blocks (`BlockToolParser`): calls sit between a start and an end marker inside free text
  (`<tool_call>...</tool_call>`). Text outside the blocks is content, streamed as it comes; the
  whitespace that separates text from a block is dropped. A block is sent once its end marker has
  arrived: a block that does not parse (bad JSON, a missing name) stays content, start and end
  markers and all (vLLM likewise falls back to content), which a call already sent could not.
  A block still open when the output ends is parsed as it is.
* The whole output (`WholeOutputToolParser`): the message is either a list of calls or plain
  content (pythonic `[f(a=1)]`, JSON `{"name": ...}`). Its first characters decide: content is
  streamed at once; a call list is sent when the output ends (one token later: the model stops right
  after it), and becomes content if it does not parse.
"""
from __future__ import annotations

from moe.entrypoints.parsers.output import ToolCall, partial_suffix


class ToolParser:
    name = ""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def stream(self):
        raise NotImplementedError


# ---- blocks between markers -------------------------------------------------------------------

class BlockToolParser(ToolParser):
    start = ""
    end = ""

    def parse_block(self, block: str) -> list[ToolCall] | None:
        """The calls of the text between the markers, or None when it is not well formed."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pieces: list[tuple[str, str, bool]] = []  # ("text", s, _) / ("block", inner, closed)
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                pieces.append(("text", text[pos:], False))
                break
            pieces.append(("text", text[pos:i], False))
            j = text.find(self.end, i + len(self.start))
            if j < 0:
                pieces.append(("block", text[i + len(self.start):], False))
                break
            pieces.append(("block", text[i + len(self.start):j], True))
            pos = j + len(self.end)
        content, calls = [], []
        for k, (kind, s, closed) in enumerate(pieces):
            if kind == "text":
                if k > 0:
                    s = s.lstrip()
                if k + 1 < len(pieces):
                    s = s.rstrip()
                content.append(s)
                continue
            parsed = self.parse_block(s)
            if parsed is None:
                content.append(self.start + s + (self.end if closed else ""))
            else:
                calls += parsed
        return "".join(content) or None, calls

    def stream(self) -> "BlockToolStream":
        return BlockToolStream(self)


class BlockToolStream:
    def __init__(self, parser: BlockToolParser) -> None:
        self.parser = parser
        self.buf = ""
        self.inside = False  # within a block: waiting for its end marker
        self.after_block = False  # the whitespace that follows a block is dropped
        self.pending_ws = ""  # trailing whitespace of the text: dropped if a block follows

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        p = self.parser
        self.buf += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if not self.inside:
                i = self.buf.find(p.start)
                if i < 0:
                    cut = len(self.buf) - partial_suffix(self.buf, p.start)
                    self._text(self.buf[:cut], content)
                    self.buf = self.buf[cut:]
                    break
                self._text(self.buf[:i], content)
                self.pending_ws = ""
                self.buf, self.inside = self.buf[i + len(p.start):], True
            else:
                j = self.buf.find(p.end)
                if j < 0:
                    break
                block, self.buf, self.inside = self.buf[:j], self.buf[j + len(p.end):], False
                self._block(block, True, content, calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        if self.inside:
            self._block(self.buf, False, content, calls)
        else:
            self._text(self.buf, content)
        content.append(self.pending_ws)
        self.buf = self.pending_ws = ""
        return "".join(content), calls

    def _text(self, s: str, out: list[str]) -> None:
        if self.after_block:
            s = s.lstrip()
            if not s:
                return
            self.after_block = False
        s = self.pending_ws + s
        body = s.rstrip()
        self.pending_ws = s[len(body):]
        if body:
            out.append(body)

    def _block(self, block: str, closed: bool, content: list[str], calls: list[ToolCall]) -> None:
        p = self.parser
        parsed = p.parse_block(block)
        if parsed is None:
            content.append(p.start + block + (p.end if closed else ""))
        else:
            calls += parsed
        self.after_block = True


# ---- the whole output -------------------------------------------------------------------------

class WholeOutputToolParser(ToolParser):
    prefixes: tuple[str, ...] = ()  # markers that may open a call list (<|python_tag|>)
    openers: tuple[str, ...] = ()  # how a call list starts, after them ("[", "{")

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        """The calls of an output that opens like a call list, or None when it is not one."""
        raise NotImplementedError

    def opening(self, text: str) -> str | None:
        """"calls" or "content" as the start of `text` decides; None while it cannot tell yet
        (nothing but whitespace, or the start of a marker)."""
        head = text.lstrip()
        for marker in self.prefixes:
            if marker.startswith(head):
                return None
            if head.startswith(marker):
                head = head[len(marker):].lstrip()
                if not head:
                    return None
                break
        if not head:
            return None
        return "calls" if head.startswith(self.openers) else "content"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = self.parse_calls(text) if self.opening(text) == "calls" else None
        if calls:
            return None, calls
        return text or None, []

    def stream(self) -> "WholeOutputStream":
        return WholeOutputStream(self)


class WholeOutputStream:
    def __init__(self, parser: WholeOutputToolParser) -> None:
        self.parser = parser
        self.buf = ""
        self.mode: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.mode == "content":
            return text, []
        self.buf += text
        if self.mode is None:
            self.mode = self.parser.opening(self.buf)
            if self.mode == "content":
                held, self.buf = self.buf, ""
                return held, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self.buf = self.buf, ""
        if self.mode == "calls":
            calls = self.parser.parse_calls(held)
            if calls:
                return "", calls
        return held, []
