"""What a request's StructuredOutputsParams means to llguidance: its grammar text, the tokenizer
llguidance matches tokens with, and the check that runs when a request is added.

vLLM's "guidance" backend is the model: a JSON schema (optionally closed to properties it does not
name, and without whitespace between items), any JSON object, a regex, one of the choices, an
EBNF (GBNF) or Lark grammar, or a structural tag (vLLM's {"structures": [...], "triggers": [...]}
form). llguidance is imported on first use only, so a process that never sees such a request does
not load it.
"""
from __future__ import annotations

import copy
import functools
import json

from moe.structured_output.params import StructuredOutputsParams

# The longest piece of a library message a ValueError quotes (llguidance appends its parser state).
_MAX_DETAIL = 600


def _detail(message: str) -> str:
    """llguidance's message without the parser dump it may append (<state>...), cut to a length."""
    text = str(message).split("<state>")[0].strip()
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL] + " ..."


def _bad(kind: str, why: str) -> ValueError:
    return ValueError(f"invalid structured_outputs.{kind}: {why}")


def _close_objects(schema):
    """vLLM's disable_additional_properties: every object schema that lists properties and says
    nothing of others gets additionalProperties: false (a copy; the caller's schema is kept)."""
    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
            if "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
                node["additionalProperties"] = False
        elif isinstance(node, list):
            for item in node:
                walk(item)

    schema = json.loads(schema) if isinstance(schema, str) else copy.deepcopy(schema)
    walk(schema)
    return schema


def _json_options(p: StructuredOutputsParams) -> dict:
    options = {"whitespace_flexible": not p.disable_any_whitespace}
    if p.whitespace_pattern is not None:
        options["whitespace_pattern"] = p.whitespace_pattern
    return options


def _schema_grammar(llg, schema, p: StructuredOutputsParams) -> str:
    if p.disable_additional_properties:
        schema = _close_objects(schema)
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(p))
    except ValueError as e:
        raise _bad("json", f"not a JSON schema object ({_detail(e)})") from None


def _structural_tag_grammar(llg, spec: str) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free
    text in which each begin (it starts with one of the triggers) opens a JSON value of its schema,
    closed by its end."""
    try:
        tag = json.loads(spec)
    except ValueError as e:
        raise _bad("structural_tag", f"not valid JSON ({e})") from None
    if not isinstance(tag, dict) or "structures" not in tag or "triggers" not in tag:
        raise _bad("structural_tag", "only the form {\"structures\": [{\"begin\", \"schema\", \"end\"}, ...], "
                                     "\"triggers\": [...]} is supported")
    triggers, structures = tag["triggers"], tag["structures"]
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise _bad("structural_tag", "triggers must be a list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise _bad("structural_tag", "structures must be a non-empty list")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or not isinstance(s.get("schema"), (dict, str)):
            raise _bad("structural_tag", f"structure {i} needs a begin and an end (strings) and a schema")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise _bad("structural_tag", f"the begin {s['begin']!r} of structure {i} starts with none of the "
                                         f"triggers {triggers}")
        schema = json.loads(s["schema"]) if isinstance(s["schema"], str) else s["schema"]
        tags.append(llg.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llg.StructTag.to_grammar(tags)


def grammar_text(p: StructuredOutputsParams) -> str:
    """The llguidance grammar of a request's constraint (what LLMatcher compiles). Raises ValueError
    naming the field for a spec it cannot even translate (the compiler checks the rest)."""
    import llguidance as llg

    kind = p.kind
    if kind == "json":
        return _schema_grammar(llg, p.json, p)
    if kind == "json_object":
        return _schema_grammar(llg, {"type": "object"}, p)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(p.regex)
    if kind == "choice":
        return llg.grammar_from("choice", p.choice)
    if kind == "grammar":
        try:  # Lark as it is, GBNF / EBNF converted to Lark
            return llg.grammar_from("grammar", p.grammar)
        except ValueError as e:
            raise _bad("grammar", _detail(e)) from None
    return _structural_tag_grammar(llg, p.structural_tag)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's tokenizer for the model (built from its tokenizer.json text; about a second for
    a 150k vocabulary, so once per process): masks have one bit per id below vocab_size (the
    logits' width), and the EOS ids are allowed exactly where the grammar accepts."""
    import llguidance as llg

    if tokenizer is None:
        raise ValueError("structured_outputs need the model's tokenizer (tokenizer.json), and this model has none")
    try:
        return llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                               eos_token=list(eos_token_ids) or None)
    except Exception as e:  # noqa: BLE001 - llguidance raises its own types; the message is what matters
        raise ValueError(f"structured_outputs: llguidance cannot use this model's tokenizer ({_detail(e)})") from None


@functools.lru_cache(maxsize=256)
def compile_error(grammar: str, tokenizer) -> str:
    """llguidance's error for a grammar against the tokenizer ('' when it compiles); cached, as a
    batch of prompts often shares one schema."""
    import llguidance as llg

    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return _detail(messages[0]) if is_error else ""


def validate(p: StructuredOutputsParams, tokenizer) -> str:
    """Check a request's constraint where it arrives (raises ValueError naming the field and the
    problem); returns its grammar text. tokenizer: ll_tokenizer(...)'s."""
    grammar = grammar_text(p)
    error = compile_error(grammar, tokenizer)
    if error:
        raise _bad(p.kind, error)
    return grammar


class LLGuidanceBackend:
    """llguidance behind the interface the manager drives (xgrammar_backend.XgrammarBackend has the
    same): compile, a matcher per sequence, batched mask fills and token consumption."""
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = ll_tokenizer(tokenizer, vocab_size, tuple(eos_token_ids))
        self._executor = None  # llguidance.LLExecutor: fills masks and consumes tokens in parallel

    @staticmethod
    def key(p: StructuredOutputsParams) -> str:
        """The grammar text: what identifies a compiled grammar (the manager's cache key)."""
        return grammar_text(p)

    def compile(self, p: StructuredOutputsParams):
        """A template matcher for the request's grammar (raises ValueError with llguidance's message)."""
        import llguidance as llg

        matcher = llg.LLMatcher(self._tokenizer, grammar_text(p), log_level=0)
        if matcher.is_error():
            raise ValueError(_detail(matcher.get_error()))
        return matcher

    @staticmethod
    def matcher(template):
        return template.deep_copy()  # a new sequence: no output tokens to replay

    @property
    def executor(self):
        if self._executor is None:
            import llguidance as llg
            self._executor = llg.LLExecutor()
        return self._executor

    def fill(self, rows: list[tuple[object, int]], bitmask) -> None:
        """Fill bitmask[i] for each (matcher, i)."""
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self.executor, rows, bitmask)

    def consume(self, pairs: list[tuple[object, int]]) -> list[bool]:
        return self.executor.consume_token_par(pairs)

    @staticmethod
    def consume_tokens(matcher, tokens: list[int]) -> bool:
        return matcher.consume_tokens(tokens)

    @staticmethod
    def is_stopped(matcher) -> bool:
        return matcher.is_stopped()

    @staticmethod
    def error(matcher) -> str:
        return _detail(matcher.get_error())
