"""StructuredOutputsParams, as vLLM spells it: what one request's output must match.

Exactly one constraint is set: `json` (a JSON schema, as a dict or its JSON text), `regex`,
`choice` (one of these strings), `grammar` (EBNF / Lark text), `json_object` (any JSON object) or
`structural_tag` (the library's JSON form). The options shape how a JSON schema is followed.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's options: JSON without whitespace between items, and objects closed to properties the
    # schema does not name (off: the schema's additionalProperties rules).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        set_ = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                             f"structural_tag; got {', '.join(set_) if set_ else 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), "
                             f"got {type(self.json).__name__}")
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {type(value).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))
