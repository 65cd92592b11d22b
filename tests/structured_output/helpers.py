"""Shared pieces of the structured-output tests: a schema the random-weight tiny model can only
satisfy through the grammar (bounded, so outputs stay short), and its hand-written check (the
venv has no jsonschema)."""
from __future__ import annotations

import json

from moe import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


def check_schema(text: str) -> dict:
    """The parsed object, asserted to satisfy SCHEMA."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "ok", "tags"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
    assert isinstance(obj["ok"], bool)
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 2 and set(obj["tags"]) <= {"a", "b"}
    return obj


def json_params(**kw) -> SamplingParams:
    """SCHEMA without free whitespace (a random model would otherwise emit whitespace until max_tokens)."""
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), **kw)


def tiny_llm(**engine_args) -> LLM:
    return LLM("tiny-qwen3-moe", device="cpu", **engine_args)


def completions(llm: LLM, prompts, params) -> list:
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]
