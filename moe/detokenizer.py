"""Incremental detokenisation with stop strings.

Text grows by decoding a short window of recent tokens: the delta is what the window's text
gained. A window whose text ends in U+FFFD is a multi-byte character cut in half, so it waits
for the next token instead of emitting a broken character.
"""
from __future__ import annotations

from moe.tokenizer import Tokenizer

# Prompt tokens kept as context so that the first output token decodes with its leading space.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self.stop_buffer = max((len(s) for s in stop), default=1) - 1

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; returns the stop string that ended the text, if one did."""
        if self.tokenizer is None:
            return None
        for token in new_token_ids:
            self.tokens.append(token)
            prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], self.skip_special_tokens)
            full = self.tokenizer.decode(self.tokens[self.prefix_offset:], self.skip_special_tokens)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta = full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
                stop = self._append(delta)
                if stop is not None:
                    return stop
        return None

    def flush(self) -> str | None:
        """At the end of generation, emit what was held back (a final incomplete character
        decodes to U+FFFD, as a full decode of the tokens would show it)."""
        if self.tokenizer is None or self.read_offset == len(self.tokens):
            return None
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.tokens)
        return self._append(full[len(prefix):]) if len(full) > len(prefix) else None

    def _append(self, delta: str) -> str | None:
        start = max(0, len(self.output_text) - self.stop_buffer)
        self.output_text += delta
        for s in self.stop:
            idx = self.output_text.find(s, start)
            if idx != -1:
                self.output_text = self.output_text[:idx + len(s) if self.include_stop else idx]
                return s
        return None
