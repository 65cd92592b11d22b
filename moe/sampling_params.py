"""SamplingParams with vLLM's names, defaults and validation.

Every value is checked when the object is made (type, range, finiteness), so a bad value fails
here with its name rather than inside a step. Checks that need the model (token ids within the
vocabulary, `logprobs` and `prompt_logprobs` against `max_logprobs`) run when the engine adds the request.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from moe.structured_output.params import StructuredOutputsParams

_EPS = 1e-5
# Integers travel to the engine core as msgpack ints and into torch int64 tensors (top_k): larger
# values fail there, inside a step, so they are refused here with the parameter's name. A seed
# may use msgpack's unsigned range: sample i of an n > 1 request is seeded with seed + i (a clone
# of these params), so a seed of INT64_MAX must leave room above it; the worker hashes seeds, so
# torch never sees one that large.
INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1


def _is_int(value) -> bool:
    """An integer that is not a bool (True is an int in Python, never a count or a token id)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value) -> str:
    """repr, except for an integer too long for it (Python refuses int -> str beyond 4300 digits)."""
    try:
        return repr(value)
    except ValueError:
        return f"<an integer of {value.bit_length()} bits>"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None   # None or -1: unseeded
    max_tokens: int | None = 16   # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None      # only these tokens may be sampled
    bad_words: list[str] | None = None              # words never generated (update_from_tokenizer)
    truncate_prompt_tokens: int | None = None       # keep the last k prompt tokens (-1: max_model_len)
    best_of: int | None = None                      # only None or n: vLLM's V1 engine dropped best_of
    # The output must match a JSON schema, regex, choice or grammar (moe/structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # bad_words as token sequences (each with and without a leading space), made from the tokenizer
    # where the request arrives; a field (as in vLLM) so that it travels to the engine core.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Filled by validation.
    stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None  # vLLM: -1 means unseeded
        self._validate()
        if self.top_k == -1:
            self.top_k = 0
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)

    def _validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"invalid sampling parameter {name}={_shown(getattr(self, name))}: {why}")

        # Types first: every later comparison may then assume a finite number.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                bad(name, f"must be a number, got {type(value).__name__}")
            if not math.isfinite(value):
                bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                bad(name, f"must be an integer, got {type(getattr(self, name)).__name__}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                bad(name, f"must be an integer or None, got {type(value).__name__}")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > INT64_MAX:
                bad(name, f"must be at most {INT64_MAX} (2**63 - 1)")
        if self.seed is not None and self.seed > SEED_MAX:
            bad("seed", f"must be at most {SEED_MAX} (2**64 - 1)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be True or False")

        if self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if self.n > 1 and self.is_greedy:
            bad("n", f"must be 1 with greedy sampling (temperature={self.temperature}): the {self.n} outputs "
                     "would be identical; set temperature > 0 for distinct samples")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be a non-negative integer")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be a non-negative integer (0: only each prompt token's own logprob)")
        if self.seed is not None and self.seed < 0:
            bad("seed", "must be a non-negative integer, or -1 / None for unseeded")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs",
                f"must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")
        self._validate_stops(bad)
        self._validate_token_controls(bad)

    def _validate_stops(self, bad) -> None:
        stop = self.stop
        if stop is not None:
            if not isinstance(stop, (str, list, tuple)) or (
                    not isinstance(stop, str) and not all(isinstance(s, str) for s in stop)):
                bad("stop", "must be a string or a list of strings")
            stops = [stop] if isinstance(stop, str) else stop
            if any(s == "" for s in stops):
                bad("stop", "must not contain empty strings")
            for i, s in enumerate(stops):
                try:
                    s.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate: no text can match it, and it cannot be sent
                    which = "" if isinstance(stop, str) else f" (string {i})"
                    bad("stop", f"must be valid Unicode text{which}: {e.reason} at position {e.start}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple))
                                or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids)):
            bad("stop_token_ids", f"must be a list of non-negative integers (each at most {INT64_MAX})")

    def _validate_token_controls(self, bad) -> None:
        def is_id(t) -> bool:
            return _is_int(t) and 0 <= t <= INT64_MAX

        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or not all(is_id(t) for t in bias):
                bad("logit_bias", "must be a dict of token id (a non-negative integer) -> bias")
            for t, b in bias.items():
                if not _is_number(b) or not -100 <= b <= 100:  # OpenAI's range; NaN fails it too
                    bad("logit_bias", f"the bias of token {t} must be a number in [-100, 100], got {_shown(b)}")
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not all(is_id(t) for t in ids):
                bad("allowed_token_ids", "must be a list of non-negative integers")
            if not ids:
                bad("allowed_token_ids", "must not be empty (None allows every token)")
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
                bad("bad_words", "must be a list of strings")
            for i, w in enumerate(words):
                if not w.strip():
                    bad("bad_words", f"must not contain empty or blank strings (word {i})")
                try:
                    w.encode("utf-8")
                except UnicodeEncodeError as e:
                    bad("bad_words", f"must be valid Unicode text (word {i}): {e.reason} at position {e.start}")
        seqs = self._bad_words_token_ids
        if seqs is not None and (not isinstance(seqs, (list, tuple)) or not all(
                isinstance(q, (list, tuple)) and q and all(is_id(t) for t in q) for q in seqs)):
            bad("_bad_words_token_ids", "must be a list of non-empty lists of token ids")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1) or k > INT64_MAX):
            bad("truncate_prompt_tokens", "must be an integer >= 1 (the last k prompt tokens are kept), "
                                          "-1 (max_model_len) or None")
        if self.best_of is not None and self.best_of != self.n:
            bad("best_of", f"is not supported (vLLM's V1 engine removed it): it may only be None or equal "
                           f"to n={self.n}; ask for n samples with logprobs and pick the best yourself")

    def update_from_tokenizer(self, tokenizer, vocab_size: int) -> None:
        """The checks that need the model (token ids within the vocabulary), and bad_words turned
        into token sequences. Each word is encoded as it stands at the start of a text and, where
        that is a different sequence of the same length, after a space (mid-text), as vLLM does."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or [])):
            out = [t for t in ids if t >= vocab_size]
            if out:
                raise ValueError(f"invalid sampling parameter {name}: token id {out[0]} is out of vocabulary "
                                 f"(vocab_size={vocab_size})")
        if not self.bad_words:
            return
        if tokenizer is None:
            raise ValueError("invalid sampling parameter bad_words: it needs a tokenizer, and this model has none")
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            seqs.append(plain)
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                seqs.append(spaced)
        out = [t for q in seqs for t in q if not 0 <= t < vocab_size]
        if out:
            raise ValueError(f"invalid sampling parameter bad_words: token id {out[0]} of its tokenization is out "
                             f"of vocabulary (vocab_size={vocab_size})")
        self._bad_words_token_ids = seqs

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    def clone(self, **changes) -> "SamplingParams":
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "stop_list"}
        fields.update(changes)
        return SamplingParams(**fields)
