"""`openai_gptoss` (reasoning) and `openai` (tool calls), vLLM's names: gpt-oss's "harmony" format.

A reply is a sequence of messages, each `<|start|>ROLE HEADER<|message|>BODY` ended by `<|end|>`,
`<|call|>` (a tool call) or `<|return|>` (the end of the turn). The prompt ends with
`<|start|>assistant`, so the output opens inside the first header:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>

The header names a channel (`analysis`: the reasoning; `final`: the answer; `commentary`: tool
calls, or without a recipient a preamble shown to the user), maybe a recipient `to=functions.NAME`
(before or after `<|channel|>`) and a content type (`<|constrain|>json`, or a bare `json`). The
special tokens must be in the text (the detokenizer run with skip_special_tokens=False).

* The reasoning parser: the analysis messages' bodies are the reasoning; the bodies of the other
  messages without a recipient (final, preambles) are the content, without their headers and
  terminators. A message with a recipient is left in the content as the model wrote it, header and
  terminator included (its header always from `<|start|>ROLE`), for the tool parser that follows.
* The tool parser reads either that content or the whole output: a message to `functions.NAME`
  (or to a bare NAME among the request's tools) is a call, its body the arguments (valid JSON
  re-serialised, anything else passed through as written, an empty body `{}`); final and preamble
  bodies and text outside messages are content; analysis messages and messages to other
  recipients (the built-in browser / python tools) are dropped.

Bodies are kept as written and several messages' texts are joined as they are. A message cut by
the end of the output (max_tokens, or a stop token whose text the output leaves out) counts as it
is; one whose header is cut before `<|message|>` is dropped. A new `<|start|>` or `<|channel|>`
inside a body ends that message. Streamed, a body's text goes out as it comes (held back only
where a special token may start), a call once its message ends; the pieces joined equal the whole
text's result for any way of cutting it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from moe.entrypoints.parsers.output import ToolCall, partial_suffix
from moe.entrypoints.parsers.tool_parser import ToolParser

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)
TERMINATORS = (END, CALL, RETURN, ENDOFTEXT)
ROLE = "assistant"
FUNCTIONS = "functions."

# What the output may start with before its first `<|channel|>` (the prompt opened the header with
# `<|start|>assistant`): whitespace and a recipient. Any text that cannot grow into this is content.
_LEAD = re.compile(r"\s*(?:t|to|to=[^\s<]*\s*)?")
_CONSTRAINED = re.compile(re.escape(CONSTRAIN) + r"\s*([^\s<]+)")


@dataclass(frozen=True)
class Header:
    """A message's header: `text` as written from its role (`assistant<|channel|>final`)."""
    text: str
    role: str | None
    channel: str | None
    recipient: str | None
    content_type: str | None


def parse_header(text: str) -> Header:
    before, has_channel, after = text.partition(CHANNEL)
    words_before = before.replace(CONSTRAIN, " ").split()
    words_after = after.replace(CONSTRAIN, " ").split()
    recipient = next((w[3:] for w in words_before + words_after if w.startswith("to=")), None) or None
    role = words_before[0] if words_before and not words_before[0].startswith("to=") else None
    channel, rest = None, words_after
    if has_channel and words_after and not words_after[0].startswith("to="):
        channel, rest = words_after[0], words_after[1:]
    m = _CONSTRAINED.search(text)
    content_type = m.group(1) if m else next((w for w in rest if not w.startswith("to=")), None)
    return Header(text, role, channel, recipient, content_type)


def _find_special(buf: str) -> tuple[int, str | None]:
    """(index, token) of the first special token in `buf`; (-1, None) without one."""
    i = buf.find("<|")
    while i >= 0:
        for tok in SPECIAL_TOKENS:
            if buf.startswith(tok, i):
                return i, tok
        i = buf.find("<|", i + 1)
    return -1, None


class HarmonyScanner:
    """Harmony text fed in pieces, as events: ("text", s) outside messages, ("open", Header),
    ("body", s), ("close", terminator: "" when a new message ended it, None when the output did).

    States: "lead" (the output's start, in the header the prompt opened, unless it turns out to be
    plain text), "top" (between messages), "header", "body"."""

    def __init__(self, role: str = ROLE) -> None:
        self.state = "lead"
        self.role = role  # the header text the prompt opened
        self.lead = ""
        self.header = ""
        self.buf = ""  # held back: what may be the start of a special token
        self._events: list[tuple[str, object]] = []

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        while True:
            i, tok = _find_special(self.buf)
            if tok is None:
                break
            self._text(self.buf[:i])
            self.buf = self.buf[i + len(tok):]
            self._special(tok)
        cut = len(self.buf) - max(partial_suffix(self.buf, tok) for tok in SPECIAL_TOKENS)
        self._text(self.buf[:cut])
        self.buf = self.buf[cut:]
        return self._take()

    def finish(self) -> list[tuple[str, object]]:
        self._text(self.buf)
        self.buf = ""
        if self.state == "lead" and self.lead:
            self._events.append(("text", self.lead))
        elif self.state == "body":
            self._events.append(("close", None))
        self.state, self.lead, self.header = "top", "", ""  # a header cut before <|message|> is dropped
        return self._take()

    def reopen_lead(self) -> None:
        """After a prompt that ends in a header (`<|start|>assistant`): the output opens in it."""
        if self.state == "header":
            self.state, self.role, self.header = "lead", self.header, ""

    def _take(self) -> list[tuple[str, object]]:
        events, self._events = self._events, []
        return events

    def _text(self, s: str) -> None:
        if not s:
            return
        if self.state == "lead":
            self.lead += s
            if not _LEAD.fullmatch(self.lead):
                self._events.append(("text", self.lead))
                self.state, self.lead = "top", ""
        elif self.state == "header":
            self.header += s
        else:
            self._events.append(("text" if self.state == "top" else "body", s))

    def _special(self, tok: str) -> None:
        state = self.state
        if state == "lead":
            if tok in (CHANNEL, CONSTRAIN, MESSAGE):  # the lead was the header's start
                self.state, self.header, self.lead = "header", self.role + self.lead, ""
            else:
                if self.lead:
                    self._events.append(("text", self.lead))
                self.state, self.lead = "top", ""
            self._special(tok)
        elif state == "top":
            if tok == START:
                self.state, self.header = "header", ""
            elif tok in (CHANNEL, CONSTRAIN, MESSAGE):  # a header without <|start|>
                self.state, self.header = "header", ROLE
                self._special(tok)
            # a terminator outside a message: dropped
        elif state == "header":
            if tok == MESSAGE:
                self._events.append(("open", parse_header(self.header)))
                self.state = "body"
            elif tok == START:
                self.header = ""
            elif tok in TERMINATORS:  # a header without a body: dropped
                self.state, self.header = "top", ""
            else:
                self.header += tok
        elif tok in TERMINATORS:
            self._events.append(("close", tok))
            self.state = "top"
        elif tok in (START, CHANNEL):
            self._events.append(("close", ""))
            self.state = "top"
            self._special(tok)
        else:  # <|message|> / <|constrain|> inside a body: its text
            self._events.append(("body", tok))


def _scanner_after(prompt: str | None) -> tuple[HarmonyScanner, Header | None]:
    """A scanner in the state the prompt leaves the reply in, and the header of the message the
    prompt left open (continue_final_message), if any."""
    scanner = HarmonyScanner()
    if not prompt or START not in prompt:
        return scanner, None
    scanner.state = "top"
    header = None
    for kind, value in scanner.feed(prompt[prompt.rindex(START):]):
        if kind == "open":
            header = value
        elif kind == "close":
            header = None
    scanner.reopen_lead()
    return scanner, header if scanner.state == "body" else None


# ---- reasoning --------------------------------------------------------------------------------

def _reasoning_kind(header: Header) -> str:
    if header.recipient:
        return "raw"
    return "reasoning" if header.channel == "analysis" else "content"


class HarmonyReasoningStream:
    """feed(text) / finish() -> (reasoning, content) of that piece."""

    def __init__(self, scanner: HarmonyScanner, header: Header | None = None) -> None:
        self.scanner = scanner
        self.kind = _reasoning_kind(header) if header is not None else None

    def feed(self, text: str) -> tuple[str, str]:
        return self._apply(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._apply(self.scanner.finish())

    def _apply(self, events) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for kind, value in events:
            if kind == "text":
                content.append(value)
            elif kind == "open":
                self.kind = _reasoning_kind(value)
                if self.kind == "raw":
                    content.append(START + value.text + MESSAGE)
            elif kind == "body":
                (reasoning if self.kind == "reasoning" else content).append(value)
            else:  # close
                if self.kind == "raw" and value is not None:
                    content.append(value or END)  # ended by a new message: <|end|> shows where
                self.kind = None
        return "".join(reasoning), "".join(content)


class HarmonyReasoningParser:
    """`openai_gptoss`: the analysis channel is the reasoning. One instance per request: a prompt
    that leaves the reply inside a message (continue_final_message) starts the output there.

    `end` is the text the reasoning ends with before the answer, and `thinking` whether the output
    starts in the reasoning: what a constraint applied after the reasoning is placed by (the server's
    after_reasoning grammar). vLLM's parser finds that point by token ids; here it is the tokens'
    text."""

    name = "openai_gptoss"
    start = CHANNEL + "analysis" + MESSAGE
    end = CHANNEL + "final" + MESSAGE

    def __init__(self, prompt: str | None = None, chat_template_kwargs: dict | None = None) -> None:
        self.prompt = prompt
        _, header = _scanner_after(prompt)
        self.thinking = header is None or _reasoning_kind(header) == "reasoning"

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        state = self.stream()
        r1, c1 = state.feed(text)
        r2, c2 = state.finish()
        return (r1 + r2) or None, (c1 + c2) or None

    def stream(self) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(*_scanner_after(self.prompt))


# ---- tool calls -------------------------------------------------------------------------------

def call_arguments(body: str, content_type: str | None) -> str:
    """A call's arguments: JSON re-serialised, other text (not JSON, or a content type other than
    JSON) as written; an empty body is no arguments, `{}`."""
    if not body.strip():
        return "{}"
    if content_type is not None and "json" not in content_type.lower():
        return body
    try:
        return json.dumps(json.loads(body), ensure_ascii=False)
    except (ValueError, RecursionError):
        return body


class HarmonyToolStream:
    """feed(text) / finish() -> (content, calls completed) of that piece."""

    def __init__(self, parser: "HarmonyToolParser") -> None:
        self.parser = parser
        self.scanner = HarmonyScanner()
        self.kind: str | None = None  # of the open message: "call", "content" or "drop"
        self.call_name = ""
        self.content_type: str | None = None
        self.arguments: list[str] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._apply(self.scanner.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._apply(self.scanner.finish())

    def _apply(self, events) -> tuple[str, list[ToolCall]]:
        content: list[str] = []
        calls: list[ToolCall] = []
        for kind, value in events:
            if kind == "text":
                content.append(value)
            elif kind == "open":
                name = self.parser.function_name(value.recipient)
                if name is not None:
                    self.kind, self.call_name, self.content_type, self.arguments = "call", name, value.content_type, []
                elif value.recipient or value.channel == "analysis":
                    self.kind = "drop"
                else:
                    self.kind = "content"
            elif kind == "body":
                if self.kind == "content":
                    content.append(value)
                elif self.kind == "call":
                    self.arguments.append(value)
            else:  # close
                if self.kind == "call":
                    calls.append(ToolCall(self.call_name, call_arguments("".join(self.arguments), self.content_type)))
                self.kind, self.arguments = None, []
        return "".join(content), calls


class HarmonyToolParser(ToolParser):
    """`openai`: gpt-oss's calls, messages to `functions.NAME` (on any channel, as the model may put
    them on analysis)."""

    name = "openai"

    def function_name(self, recipient: str | None) -> str | None:
        """The function a message's recipient calls, None when it calls none."""
        if not recipient:
            return None
        if recipient.startswith(FUNCTIONS):
            return recipient[len(FUNCTIONS):] or None
        names = {t.get("function", {}).get("name") for t in self.tools if isinstance(t, dict)}
        return recipient if recipient in names else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        state = self.stream()
        c1, calls1 = state.feed(text)
        c2, calls2 = state.finish()
        return (c1 + c2) or None, calls1 + calls2

    def stream(self) -> HarmonyToolStream:
        return HarmonyToolStream(self)
