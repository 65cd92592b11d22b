"""Structured outputs on the server: a request's `response_format` (OpenAI's) and
`structured_outputs` (vLLM's extension, StructuredOutputsParams' fields) as the request's
StructuredOutputsParams, and, for a reasoning model, the grammar that lets it reason first.

As in vLLM, response_format sets its constraint on top of structured_outputs' fields (so
structured_outputs may carry the options, `disable_any_whitespace` and the like); two constraints
are refused by StructuredOutputsParams. A schema's `strict` changes nothing: the schema is always
enforced.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from moe.structured_output import StructuredOutputsParams
from moe.structured_output.params import CONSTRAINTS

logger = logging.getLogger("moe.entrypoints.serve")

_FIELDS = frozenset(StructuredOutputsParams.__dataclass_fields__)


def response_format_constraint(response_format) -> dict[str, Any]:
    """The StructuredOutputsParams fields a response_format sets ({} for "text")."""
    kind = response_format.type
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema (the JSON schema)")
        return {"json": spec.schema_}
    if kind == "structural_tag":  # vLLM's form: {"type", "structures": [{"begin", "schema", "end"}], "triggers"}
        return {"structural_tag": json.dumps({"structures": response_format.structures or [],
                                              "triggers": response_format.triggers or []})}
    return {}


def _spec(structured_outputs: dict | None, response_format) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if structured_outputs is not None:
        ignored = sorted(str(k) for k in structured_outputs if k not in _FIELDS)
        if ignored:
            logger.warning("fields of structured_outputs ignored: %s", ", ".join(ignored))
        spec = {k: v for k, v in structured_outputs.items() if k in _FIELDS}
        if isinstance(spec.get("structural_tag"), (dict, list)):  # its JSON given as an object
            spec["structural_tag"] = json.dumps(spec["structural_tag"])
    if response_format is not None:
        spec.update(response_format_constraint(response_format))
    return spec


def request_constraint(structured_outputs: dict | None, response_format) -> StructuredOutputsParams | None:
    """The request's constraint, None without one; ValueError naming what is wrong."""
    spec = _spec(structured_outputs, response_format)
    if structured_outputs is None and not spec:
        return None
    return StructuredOutputsParams(**spec)


def forced_call_constraint(tool_constraint: StructuredOutputsParams, structured_outputs: dict | None,
                           response_format) -> StructuredOutputsParams:
    """A forced tool call's grammar, with the options the request's structured_outputs gives
    (disable_any_whitespace, ...); a constraint of the request's own as well is refused, as by vLLM."""
    spec = _spec(structured_outputs, response_format)
    if any(spec.get(kind) not in (None, False) for kind in CONSTRAINTS):
        raise ValueError("You can only either use constraints for structured outputs or tools, not both.")
    return dataclasses.replace(tool_constraint, **spec)


def _regex_literal(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch for ch in text)


def _content_rule(p: StructuredOutputsParams) -> str:
    """p's grammar as one Lark rule body: an inline JSON schema, or its Lark grammar nested."""
    from moe.structured_output.grammar import grammar_text

    grammar = grammar_text(p)
    if grammar.lstrip().startswith("{"):  # llguidance's JSON form: {"grammars": [{json_schema | lark_grammar}]}
        first = json.loads(grammar)["grammars"][0]
        if first.get("json_schema") is not None:
            return "%json " + json.dumps(first["json_schema"])
        grammar = first["lark_grammar"]
    return "%lark {\n" + grammar + "\n}"


def after_reasoning(p: StructuredOutputsParams, end_marker: str) -> StructuredOutputsParams:
    """p, applied to what follows the reasoning: any text up to the first `end_marker` (whatever
    the model thinks is its own), whitespace, then p's constraint. A reasoning parser reads the
    same split, so the content it returns is what p constrains."""
    lark = ("%llguidance {}\n"
            "start: reasoning WS content\n"
            f"reasoning[lazy]: /(?s:.*){_regex_literal(end_marker)}/\n"
            "WS: /[ \\t\\r\\n]*/\n"
            f"content: {_content_rule(p)}\n")
    return StructuredOutputsParams(grammar=lark)
