"""xgrammar, the optional grammar library (vLLM's default backend): used when it is installed
(`pip install "moe-runtime[xgrammar]"`) for the constraints it can express, as vLLM's "auto" does.

Measured on a 150k vocabulary (BENCHMARKS.md §10) its mask fill is 3-5x faster than llguidance's on a
typical schema and 25-100x faster inside a string with maxLength, llguidance's slow case. It is not a
core dependency because it pulls transformers and triton into every install.

The same interface as grammar.LLGuidanceBackend (the manager drives either): compile a request's
constraint off the step loop, give each sequence a matcher, fill rows of the shared int32 bitmask
(the same packing: bit t % 32 of word t // 32 allows token t), consume sampled tokens.
"""
from __future__ import annotations

import functools
import json

from moe.structured_output.params import StructuredOutputsParams

NAME = "xgrammar"
_ROWS_ON_THIS_THREAD = 4


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not usable here
        return False
    return True


def _bad(kind: str, why: str) -> ValueError:
    return ValueError(f"invalid structured_outputs.{kind}: {why}")


def unsupported(p: StructuredOutputsParams) -> str | None:
    """Why xgrammar cannot take this constraint (None: it can). "auto" sends these to llguidance."""
    if p.kind in ("json", "json_object") and p.whitespace_pattern is not None:
        return "xgrammar has no whitespace_pattern"
    if p.kind == "grammar" and ("%llguidance" in p.grammar or "%lark" in p.grammar):
        return "the grammar uses llguidance's Lark extensions"
    return None


def accepts(p: StructuredOutputsParams) -> bool:
    """Whether xgrammar can build this constraint (what "auto" asks; cached by the spec)."""
    return unsupported(p) is None and _builds(_spec_key(p))


def _spec_key(p: StructuredOutputsParams) -> str:
    return json.dumps([p.kind, getattr(p, p.kind), p.disable_any_whitespace, p.disable_additional_properties],
                      sort_keys=True, default=str)


@functools.lru_cache(maxsize=256)
def _builds(key: str) -> bool:
    kind, spec, no_whitespace, closed = json.loads(key)
    try:
        grammar(StructuredOutputsParams(**{kind: spec}, disable_any_whitespace=no_whitespace,
                                        disable_additional_properties=closed))
    except ValueError:
        return False
    return True


def _message(e: Exception) -> str:
    """xgrammar's error text without its '[time] file.cc:line:' prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


# xgrammar 0.2.9 writes a string with minLength / maxLength as repeats of this class, which lets raw
# control characters (U+0000-U+001F, invalid in JSON strings) through; its unbounded strings exclude them.
_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def _no_raw_control_characters(xgr, g):
    text = str(g)
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)) \
        if _BOUNDED_STRING_CHARACTER in text else g


def _choice_ebnf(choices: list[str]) -> str:
    # json.dumps escapes quotes, backslashes and control characters as the EBNF string syntax reads them
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def grammar(p: StructuredOutputsParams):
    """The xgrammar Grammar of a constraint (no tokenizer needed: this is also the check a request
    gets where it arrives). Raises ValueError naming the field and xgrammar's reason."""
    import xgrammar as xgr

    why = unsupported(p)
    if why:
        raise _bad(p.kind, f"{why}; use structured_outputs_config backend 'auto' or 'guidance'")
    kind = p.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else p.json
            if isinstance(schema, str):
                json.loads(schema)  # a clear error for text that is not JSON
            g = xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                             any_whitespace=not p.disable_any_whitespace,
                                             strict_mode=p.disable_additional_properties)
            return _no_raw_control_characters(xgr, g)
        if kind == "regex":
            return xgr.Grammar.from_regex(p.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(p.choice))
        if kind == "grammar":  # GBNF / EBNF (rules with ::=), else Lark, as vLLM tells them apart
            return xgr.Grammar.from_ebnf(p.grammar) if "::=" in p.grammar else xgr.Grammar.from_lark(p.grammar)
        return _structural_tag(xgr, p.structural_tag)
    except ValueError as e:
        raise _bad(kind, _message(e)) from None
    except RuntimeError as e:
        raise _bad(kind, _message(e)) from None


def _structural_tag(xgr, spec: str):
    """vLLM's structural tag form {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    try:
        tag = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"] \
            or not isinstance(tag.get("triggers"), list):
        raise ValueError("only the form {\"structures\": [{\"begin\", \"schema\", \"end\"}, ...], \"triggers\": "
                         "[...]} is supported")
    items = []
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or not isinstance(s.get("schema"), (dict, str)):
            raise ValueError(f"structure {i} needs a begin and an end (strings) and a schema")
        schema = s["schema"] if isinstance(s["schema"], str) else json.dumps(s["schema"])
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=schema, end=s["end"]))
    return xgr.Grammar.from_structural_tag(items, tag["triggers"])


class XgrammarBackend:
    """One tokenizer's compiler (with xgrammar's own cache) and the per-step batch operations."""
    name = NAME

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers

        if tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer (tokenizer.json), and this model has none")
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._xgr = xgr
        self._stop = tuple(eos_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=8)
        self._batch = xgr.BatchGrammarMatcher()
        self._num_words = (vocab_size + 31) // 32

    @staticmethod
    def key(p: StructuredOutputsParams) -> str:
        """What identifies a compiled grammar (the manager's cache key); checks the spec."""
        grammar(p)
        return NAME + _spec_key(p)

    def compile(self, p: StructuredOutputsParams):
        """A compiled grammar (runs in the manager's thread pool); ValueError on failure."""
        try:
            return self._compiler.compile_grammar(grammar(p))
        except RuntimeError as e:
            raise ValueError(_message(e)) from None

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, rows: list[tuple[object, int]], bitmask) -> None:
        """Fill bitmask[i] for each (matcher, i). A few rows are filled on this thread: handing them to
        the batch matcher's threads costs more (0.25 ms for one row on a 16-core host)."""
        if len(rows) <= _ROWS_ON_THIS_THREAD:
            for m, i in rows:
                m.fill_next_token_bitmask(bitmask, i)
            return
        self._batch.batch_fill_next_token_bitmask([m for m, _ in rows], bitmask, indices=[i for _, i in rows])

    def consume(self, pairs: list[tuple[object, int]]) -> list[bool]:
        return self._xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in pairs], [t for _, t in pairs])

    @staticmethod
    def consume_tokens(matcher, tokens: list[int]) -> bool:
        return all(matcher.accept_token(t) for t in tokens)

    def is_stopped(self, matcher) -> bool:
        """Nothing but EOS may follow (llguidance's "stopped"): xgrammar says only whether the grammar
        may end here, so a matcher that may is asked for its next mask (rare: once per document)."""
        if matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        import numpy as np

        mask = np.zeros((1, self._num_words), dtype=np.int32)
        matcher.fill_next_token_bitmask(mask)
        words = mask.view(np.uint32)[0]
        for t in self._stop:
            words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return not words.any()

    @staticmethod
    def error(matcher) -> str:
        return "xgrammar refused it"
