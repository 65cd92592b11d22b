"""Incremental detokenisation with stop strings.

With stop strings, each token goes through the tokenizers library's DecodeStream as it comes
(one call into Rust per token), which holds back a multi-byte character cut across tokens until
it is whole, and the stop strings are searched in the new text. Without stop strings nothing
needs the text before it is read: the tokens are only collected, and a read at the end makes the
text with one full decode (a read mid-generation streams the tokens instead). Either way the text
equals a full decode of the output tokens.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from moe.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool = True) -> None:
        # The prompt is not needed: byte-level and metaspace decoders give the text of the
        # output tokens alone the way a full decode of them does.
        del prompt_token_ids
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if tokenizer is not None else None
        self._pending: list[int] = []  # tokens not yet visible in the text (a partial character)
        # Text pieces, joined on read: appending to one growing string would copy it every token.
        self._pieces: list[str] = []
        self._text: str | None = ""
        self.stop_buffer = max((len(s) for s in stop), default=1) - 1
        self._unread: list[int] = []  # no stop strings: tokens not decoded yet
        self._streamed = False  # some token went through the stream
        self._finished = False

    @property
    def output_text(self) -> str:
        if self._unread:
            if self._finished and not self._streamed:
                self._pieces = [self.tokenizer.decode(self._unread, self.skip_special_tokens)]
            else:
                self._feed(self._unread)
                if self._finished:
                    self._flush_pending()
            self._unread = []
            self._text = None
        if self._text is None:
            self._text = "".join(self._pieces)
            self._pieces = [self._text]
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that ended the text, if one did."""
        if self.tokenizer is None:
            return None
        if not self.stop:
            self._unread.extend(new_token_ids)
            return None
        return self._feed(new_token_ids)

    def _feed(self, token_ids: list[int]) -> str | None:
        self._streamed = True
        for token in token_ids:
            chunk = self._stream.step(self.tokenizer.backend, token)
            if chunk is None:
                self._pending.append(token)
                continue
            self._pending = []
            if chunk:
                stop = self._append(chunk)
                if stop is not None:
                    return stop
        return None

    def flush(self) -> str | None:
        """At the end of generation, emit what was held back (a final incomplete character
        decodes to U+FFFD, as a full decode of the tokens would show it)."""
        self._finished = True
        if self._unread:
            return None  # decoded when read
        return self._flush_pending()

    def _flush_pending(self) -> str | None:
        if self.tokenizer is None or not self._pending:
            return None
        text = self.tokenizer.decode(self._pending, self.skip_special_tokens)
        self._pending = []
        return self._append(text) if text else None

    def _append(self, delta: str) -> str | None:
        self._pieces.append(delta)
        self._text = None
        if not self.stop:
            return None
        # A stop string can only end in this delta: search it and the few characters before it.
        text = self.output_text
        start = max(0, len(text) - len(delta) - self.stop_buffer)
        for s in self.stop:
            idx = text.find(s, start)
            if idx != -1:
                self._text = text[:idx + len(s) if self.include_stop else idx]
                self._pieces = [self._text]
                return s
        return None
