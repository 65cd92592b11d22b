"""The engine's structured-output settings (vLLM's `structured_outputs_config`) and which grammar
library takes a request.

backend: "auto" (the default, as vLLM's): xgrammar when it is installed and builds the constraint,
else llguidance (which also names the error of a spec neither builds); "guidance": llguidance
always; "xgrammar": xgrammar always (a constraint it cannot express is refused). vLLM's
"outlines" and "lm-format-enforcer" are refused by name. disable_any_whitespace and
disable_additional_properties: engine-wide defaults of the request fields of the same names
(either turns the option on).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from moe.structured_output import xgrammar_backend
from moe.structured_output.params import StructuredOutputsParams

BACKENDS = ("auto", "guidance", "xgrammar")
_REFUSED_BACKENDS = ("outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @classmethod
    def parse(cls, value: "StructuredOutputsConfig | dict | str | None") -> "StructuredOutputsConfig":
        """From a dict, a JSON string (the CLI's --structured-outputs-config) or None (the defaults)."""
        if value is None or isinstance(value, StructuredOutputsConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r} ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a dict with keys {_KEYS}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown key(s) {unknown}; the keys are {_KEYS}")
        backend = value.get("backend", "auto")
        if backend in _REFUSED_BACKENDS:
            raise ValueError(f"structured_outputs_config backend {backend!r} is not supported; the backends are "
                             f"{BACKENDS}")
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "xgrammar" and not xgrammar_backend.available():
            raise ValueError("structured_outputs_config backend 'xgrammar' needs the xgrammar package "
                             "(pip install \"moe-runtime[xgrammar]\"), which does not import here")
        for key in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(value.get(key, False), bool):
                raise ValueError(f"structured_outputs_config['{key}'] must be true or false, got {value[key]!r}")
        return cls(**value)

    def apply(self, p: StructuredOutputsParams) -> StructuredOutputsParams:
        """The request's params with the engine-wide defaults turned on."""
        changes = {k: True for k in ("disable_any_whitespace", "disable_additional_properties")
                   if getattr(self, k) and not getattr(p, k)}
        return dataclasses.replace(p, **changes) if changes else p

    def backend_for(self, p: StructuredOutputsParams) -> str:
        """'guidance' or 'xgrammar': the library that takes this request."""
        if self.backend == "auto":
            use_xgrammar = xgrammar_backend.available() and xgrammar_backend.accepts(p)
            return "xgrammar" if use_xgrammar else "guidance"
        return self.backend


_KEYS = tuple(f.name for f in dataclasses.fields(StructuredOutputsConfig))
