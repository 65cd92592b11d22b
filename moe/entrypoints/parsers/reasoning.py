"""Reasoning parsers (`moe serve --reasoning-parser NAME`, vLLM's names): the text a model writes
between its think markers, `<think>` ... `</think>`, becomes the message's reasoning, the rest its
content.

Both parsers follow vLLM's current semantics:

* The chat template may open the reasoning itself (DeepSeek-R1's, Qwen3.5's end the prompt with
  `<think>`): text before `</think>` is reasoning whether or not the output opens it; a `<think>`
  that opens the output (after whitespace at most) is dropped.
* Output that never closes it (cut by max_tokens) is all reasoning.
* A prompt that already closed it (a template given `enable_thinking: false` ends the prompt with
  an empty `<think>\\n\\n</think>`) makes the whole output content; so does Qwen3's
  `chat_template_kwargs={"enable_thinking": false}` by itself.

Text around the markers is kept as the model wrote it ("\\n\\nThe answer" after `</think>`), as
vLLM does.
"""
from __future__ import annotations

from moe.entrypoints.parsers.harmony import HarmonyReasoningParser
from moe.entrypoints.parsers.output import partial_suffix


class ReasoningStream:
    """The incremental state of one message: feed(text) -> (reasoning, content) of that piece."""

    def __init__(self, parser: "ThinkingReasoningParser") -> None:
        self.start, self.end = parser.start, parser.end
        # "open": nothing but whitespace yet, a <think> may still come; "reasoning"; "content"
        self.state = "open" if parser.thinking else "content"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        if self.state == "content":
            return "", text
        self.buf += text
        if self.state == "open":
            head = self.buf.lstrip()
            if not head or (self.start.startswith(head) and head != self.start):
                return "", ""  # whitespace, or what may be the opening marker
            if head.startswith(self.start):
                self.buf = head[len(self.start):]
            self.state = "reasoning"
        i = self.buf.find(self.end)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(self.end):]
            self.buf, self.state = "", "content"
            return reasoning, content
        keep = partial_suffix(self.buf, self.end)
        reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning (the output ended before closing it)."""
        held, self.buf = self.buf, ""
        return (held, "") if self.state != "content" else ("", held)


class ThinkingReasoningParser:
    """Reasoning between `start` and `end` markers; one instance per request (its prompt and
    chat_template_kwargs decide whether the output starts inside the reasoning)."""

    name = ""
    start = "<think>"
    end = "</think>"

    def __init__(self, prompt: str | None = None, chat_template_kwargs: dict | None = None) -> None:
        self.thinking = not (prompt is not None and prompt.rstrip().endswith(self.end))

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        if not self.thinking:
            return None, text or None
        head = text.lstrip()
        if head.startswith(self.start):
            text = head[len(self.start):]
        reasoning, found, content = text.partition(self.end)
        if not found:
            return text or None, None
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class DeepSeekR1ReasoningParser(ThinkingReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ThinkingReasoningParser):
    """Qwen3: `chat_template_kwargs={"enable_thinking": false}` turns the reasoning off (its
    templates then write an empty think block into the prompt, and the model answers directly)."""

    name = "qwen3"

    def __init__(self, prompt: str | None = None, chat_template_kwargs: dict | None = None) -> None:
        super().__init__(prompt, chat_template_kwargs)
        if not (chat_template_kwargs or {}).get("enable_thinking", True):
            self.thinking = False


# openai_gptoss (gpt-oss's harmony channels, harmony.py) has the same interface: extract, stream,
# thinking and end
REASONING_PARSERS: dict[str, type[ThinkingReasoningParser] | type[HarmonyReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)}
