"""The server's constraints: response_format and structured_outputs into StructuredOutputsParams,
the grammars of forced tool calls, and the grammar that applies a constraint after the reasoning,
checked with llguidance on the tiny model's tokenizer (what it accepts, token by token)."""
from __future__ import annotations

import json

import pytest

from moe.entrypoints.serve.constraints import after_reasoning, forced_call_constraint, request_constraint
from moe.entrypoints.serve.protocol import ResponseFormat
from moe.entrypoints.serve.tool_choice import required_schema
from moe.structured_output import StructuredOutputsParams as P


@pytest.fixture(scope="module")
def accepts():
    """accepts(params, text): whether the grammar of params takes exactly `text` (then may end)."""
    import llguidance as llg

    from models.tiny import ensure_tiny_model
    from moe.engine.tokenizer import Tokenizer
    from moe.structured_output.grammar import ll_tokenizer, validate

    tok = Tokenizer(ensure_tiny_model("tiny-qwen3-moe"))
    ll_tok = ll_tokenizer(tok, tok.vocab_size, (0,))

    def check(params: P, text: str) -> bool:
        matcher = llg.LLMatcher(ll_tok, validate(params, ll_tok), log_level=0)
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return check


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_response_format_over_structured_outputs_options():
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert request_constraint({"disable_any_whitespace": True}, fmt) == P(json=SCHEMA, disable_any_whitespace=True)
    assert request_constraint(None, ResponseFormat(type="json_object")) == P(json_object=True)
    assert request_constraint(None, ResponseFormat(type="text")) is None and request_constraint(None, None) is None
    tag = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}
    assert json.loads(request_constraint({"structural_tag": tag}, None).structural_tag) == tag
    with pytest.raises(ValueError, match="exactly one"):
        request_constraint({"regex": "a"}, fmt)
    with pytest.raises(ValueError, match="exactly one"):
        request_constraint({}, None)
    with pytest.raises(ValueError, match="not both"):
        forced_call_constraint(P(json=SCHEMA), {"regex": "a"}, None)
    assert forced_call_constraint(P(json=SCHEMA), {"disable_any_whitespace": True}, None).disable_any_whitespace


@pytest.mark.parametrize("params,good,bad", [
    (P(json=SCHEMA), ['<think>\nhm, {a}\n</think>\n\n{"a": 5}', '</think>{"a":1}'], ['{"a": 5}', "x</think>{}"]),
    (P(regex="[0-9]{3}"), ["r</think>123"], ["123", "r</think>1234"]),
    (P(choice=["yes", "no"]), ["</think> no"], ["no"]),
    (P(grammar='root ::= "ans=" [xyz]'), ["q</think>ans=y"], ["ans=y"]),
])
def test_a_constraint_after_the_reasoning(accepts, params, good, bad):
    wrapped = after_reasoning(params, "</think>")
    assert all(accepts(wrapped, t) for t in good) and not any(accepts(wrapped, t) for t in bad)


def test_required_tool_choice_schema(accepts):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "required": ["x"],
        "$defs": {"X": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools)
    assert schema["$defs"] == {"X": {"type": "integer"}} and schema["minItems"] == 1 and "maxItems" not in schema
    params = P(json=schema, disable_any_whitespace=True)
    assert accepts(params, '[{"name":"f","parameters":{"x":3}},{"name":"g","parameters":{}}]')
    assert not accepts(params, '[{"name":"f","parameters":{"x":"3"}}]')
    assert not accepts(params, "[]") and not accepts(params, '[{"name":"h","parameters":{}}]')
    one = P(json=required_schema(tools, parallel=False), disable_any_whitespace=True)
    assert accepts(one, '[{"name":"g","parameters":{}}]')
    assert not accepts(one, '[{"name":"g","parameters":{}},{"name":"g","parameters":{}}]')
