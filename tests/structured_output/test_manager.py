"""StructuredOutputManager on llguidance and the grammar translation on their own (no model): the
bitmask it fills is llguidance's own mask, matchers follow their sequence's tokens, a grammar is compiled
once per spec, a complete grammar stops its sequence, a compile failure in the engine core is
reported for that request, and structural tags constrain only their tagged segments."""
from __future__ import annotations

import json

import numpy as np
import pytest

from models.tiny import ensure_tiny_model
from moe.engine.tokenizer import Tokenizer
from moe.structured_output import StructuredOutputsParams
from moe.structured_output.config import StructuredOutputsConfig
from moe.structured_output.grammar import grammar_text, ll_tokenizer, validate
from moe.structured_output.manager import StructuredOutputManager
from moe.sampling_params import SamplingParams
from scheduler import CachedRequestData, Request, RequestStatus, SchedulerOutput
from scheduler.output import EngineCoreOutput

V, EOS = 512, (0, 511)
GUIDANCE = StructuredOutputsConfig(backend="guidance")


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(ensure_tiny_model("tiny-qwen3-moe"))


def _request(rid, spec: StructuredOutputsParams, prompt=(1, 2, 3)) -> Request:
    return Request(rid, list(prompt), 50, EOS, sampling_params=SamplingParams(structured_outputs=spec),
                   use_structured_output=True)


def _ready(manager: StructuredOutputManager, *requests) -> None:
    for r in requests:
        manager.add_request(r)
    while manager.num_compiling:
        assert manager.poll(block=True) == {}
    for r in requests:
        assert r.status == RequestStatus.WAITING


def _step(rids, requests) -> SchedulerOutput:
    for r in requests:
        r.num_computed_tokens = r.num_tokens  # every row reaches its end: it samples
    return SchedulerOutput([], CachedRequestData(), {rid: 1 for rid in rids}, len(rids))


def _allowed(bitmask_row: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:V])[0].tolist())


def test_bitmask_is_the_matchers_mask_and_follows_the_tokens(tokenizer):
    import llguidance as llg

    manager = StructuredOutputManager(tokenizer, V, EOS, GUIDANCE)
    spec = StructuredOutputsParams(regex="ab[0-9]")
    a, plain, b = _request("a", spec), Request("plain", [1, 2], 5), _request("b", spec, prompt=(7,))
    _ready(manager, a, b)
    text = tokenizer.encode("ab7", add_special_tokens=False)
    own = llg.LLMatcher(ll_tokenizer(tokenizer, V, EOS), grammar_text(spec))
    for i, token in enumerate(text):
        so = _step(["a", "plain", "b"], [a, plain, b])
        manager.fill_bitmask(so)
        assert so.structured_output_request_ids == ["a", "b"] and so.grammar_bitmask.shape == (2, V // 32)
        want = set(np.nonzero(np.frombuffer(own.compute_logit_bias(), dtype=np.uint8))[0].tolist())
        assert _allowed(so.grammar_bitmask[0]) == _allowed(so.grammar_bitmask[1]) == want
        assert token in want and 0 not in want  # EOS only where the regex accepts
        a.all_token_ids.append(token)
        b.all_token_ids.append(token)
        last = i == len(text) - 1
        outs = [EngineCoreOutput("a", [token]), EngineCoreOutput("plain", [9]), EngineCoreOutput("b", [token])]
        stopped, errors = manager.advance(outs)
        assert errors == {} and stopped == (["a", "b"] if last else [])
        own.consume_token(token)
    assert "a" not in manager and "b" not in manager  # a complete grammar's sequence is forgotten


def test_one_compilation_per_spec_and_a_refused_token(tokenizer):
    manager = StructuredOutputManager(tokenizer, V, EOS, GUIDANCE)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    reqs = [_request(f"r{i}", StructuredOutputsParams(choice=["yes", "no"])) for i in range(3)]
    _ready(manager, *reqs)
    assert manager.num_compiled == 1
    _ready(manager, _request("other", StructuredOutputsParams(choice=["no", "yes"])))
    assert manager.num_compiled == 2
    bad = tokenizer.encode("zzz", add_special_tokens=False)[0]
    stopped, errors = manager.advance([EngineCoreOutput("r0", [bad])])
    assert stopped == [] and "r0" in errors and "refused token" in errors["r0"] and spec.kind in errors["r0"]
    assert "r0" not in manager


def test_a_grammar_that_fails_in_the_core_is_reported(tokenizer, monkeypatch):
    import moe.structured_output.manager as manager_mod

    def broken(backend_future, params):
        raise ValueError("the core's limits are lower")

    monkeypatch.setattr(manager_mod, "_compile", broken)
    manager = StructuredOutputManager(tokenizer, V, EOS, GUIDANCE)
    r = _request("r", StructuredOutputsParams(regex="x+"))
    manager.add_request(r)
    errors = {}
    while not errors:
        errors = manager.poll(block=True)
    assert errors == {"r": "invalid structured_outputs.regex: the core's limits are lower"}
    assert "r" not in manager


def test_engine_core_finishes_a_request_whose_grammar_fails_and_goes_on(monkeypatch):
    import moe.structured_output.manager as manager_mod
    from moe import LLM
    from moe.errors import RequestFailed

    real = manager_mod._compile

    def picky(backend_future, params):
        if "zzz" in (params.regex or ""):
            raise ValueError("too complex here")
        return real(backend_future, params)

    monkeypatch.setattr(manager_mod, "_compile", picky)
    llm = LLM("tiny-qwen3-moe", device="cpu")
    with pytest.raises(RequestFailed, match="invalid structured_outputs.regex: too complex here"):
        llm.generate(["Hi"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="zzz")), use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(
        regex="[ab]{3}")), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.text) == 3 and set(out.text) <= {"a", "b"}


def test_structural_tag_constrains_the_tagged_segment_only(tokenizer):
    import llguidance as llg

    tag = {"structures": [{"begin": "<f=x>", "schema": {"type": "object", "properties": {"v": {"enum": [1, 2]}},
                                                         "required": ["v"], "additionalProperties": False},
                           "end": "</f>"}], "triggers": ["<f="]}
    tok = ll_tokenizer(tokenizer, V, EOS)
    grammar = validate(StructuredOutputsParams(structural_tag=json.dumps(tag)), tok)

    def accepts(text: str) -> bool:
        m = llg.LLMatcher(tok, grammar)
        return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and not m.is_error()

    assert accepts('free text <f=x>{"v": 2}</f> more')
    assert not accepts('free text <f=x>{"v": 3}</f>')


def test_disable_additional_properties_closes_objects(tokenizer):
    import llguidance as llg

    tok = ll_tokenizer(tokenizer, V, EOS)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for closed in (False, True):
        spec = StructuredOutputsParams(json=schema, disable_additional_properties=closed)
        m = llg.LLMatcher(tok, validate(spec, tok))
        assert m.consume_tokens(tokenizer.encode('{"a": 1, "b"', add_special_tokens=False)) is not closed
    assert "additionalProperties" not in schema, "the caller's schema is not changed"
