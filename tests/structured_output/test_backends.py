"""The two grammar libraries behind the manager: which one takes a request (structured_outputs_config
backend auto / guidance / xgrammar), xgrammar's masks are its own matcher's and equal llguidance's for
the same regex and choice, a complete grammar stops on both, xgrammar's bounded JSON strings admit no
raw control characters, and bad configs are errors that name the problem."""
from __future__ import annotations

import numpy as np
import pytest

from models.tiny import ensure_tiny_model
from moe.engine.tokenizer import Tokenizer
from moe.structured_output import StructuredOutputsParams, xgrammar_backend
from moe.structured_output.config import StructuredOutputsConfig
from moe.structured_output.grammar import LLGuidanceBackend
from moe.structured_output.manager import StructuredOutputManager
from tests.structured_output.test_manager import V, EOS, _allowed, _ready, _request, _step

pytest.importorskip("xgrammar")  # a test dependency (pyproject's [test] extra)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(ensure_tiny_model("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def backends(tokenizer):
    return {"guidance": LLGuidanceBackend(tokenizer, V, EOS),
            "xgrammar": xgrammar_backend.XgrammarBackend(tokenizer, V, EOS)}


def _mask(backend, matcher) -> set[int]:
    bitmask = np.zeros((1, (V + 31) // 32), dtype=np.int32)
    backend.fill([(matcher, 0)], bitmask)
    return _allowed(bitmask[0])


# Where the grammar forces a piece of text, llguidance admits only its canonical tokens, xgrammar any
# token that spells it: there the masks nest instead of being equal.
@pytest.mark.parametrize("spec, text, equal", [
    (StructuredOutputsParams(regex=r"[a-c]{2}[0-9]+-(x|yz)"), "ab12-yz", True),
    (StructuredOutputsParams(choice=["north", "north-east", "south \"quoted\""]), "north-east", False),
])
def test_both_libraries_allow_the_same_tokens_along_a_text(backends, tokenizer, spec, text, equal):
    ids = tokenizer.encode(text, add_special_tokens=False)
    matchers = {name: b.matcher(b.compile(spec)) for name, b in backends.items()}
    for i, token in enumerate(ids):
        masks = {name: _mask(backends[name], m) for name, m in matchers.items()}
        if equal:
            assert masks["guidance"] == masks["xgrammar"], f"after {i} tokens of {text!r}"
        assert token in masks["guidance"] and masks["guidance"] <= masks["xgrammar"], f"after {i} tokens"
        for name, m in matchers.items():
            assert backends[name].consume([(m, token)]) == [True]
    for name, m in matchers.items():
        assert _mask(backends[name], m) == set(EOS), name  # complete: only EOS may follow
        assert backends[name].is_stopped(m), name


def test_an_open_ended_regex_is_not_stopped_where_it_may_go_on(backends, tokenizer):
    spec = StructuredOutputsParams(regex="[a-z]+")
    for name, b in backends.items():
        m = b.matcher(b.compile(spec))
        assert b.consume([(m, tokenizer.encode("a", add_special_tokens=False)[0])]) == [True]
        assert not b.is_stopped(m), name
        allowed = _mask(b, m)
        assert set(EOS) <= allowed and len(allowed) > len(EOS), name


def test_bounded_json_strings_admit_no_raw_control_characters(backends, tokenizer):
    """xgrammar 0.2.9 writes minLength / maxLength strings with a class that lets U+0000-U+001F
    through (invalid JSON); the backend rewrites the class. Control bytes are tokens 0-255's."""
    control = {i for i in range(V) if any(b < 0x20 for b in tokenizer.backend.decode([i]).encode())
               and tokenizer.backend.decode([i]).strip()}
    control |= {tokenizer.backend.token_to_id(chr(0x100 + c)) for c in range(0x20)} - {None}
    assert control, "the tiny vocabulary has byte tokens for control characters"
    for schema in ({"type": "string", "maxLength": 6}, {"type": "string", "minLength": 2}, {"type": "string"}):
        spec = StructuredOutputsParams(json=schema)
        for name, b in backends.items():
            m = b.matcher(b.compile(spec))
            assert b.consume([(m, tokenizer.encode('"', add_special_tokens=False)[0])]) == [True]
            allowed = _mask(b, m)
            assert allowed and not allowed & control, (name, schema, sorted(allowed & control))


@pytest.mark.parametrize("rows", [2, 7])  # on the engine's thread / through the batch matcher's threads
def test_the_manager_fills_xgrammar_rows_as_its_matchers_do(tokenizer, backends, rows):
    manager = StructuredOutputManager(tokenizer, V, EOS, StructuredOutputsConfig(backend="xgrammar"))
    specs = [StructuredOutputsParams(regex="ab[0-9]"), StructuredOutputsParams(choice=["yes", "no"])]
    requests = [_request(f"r{i}", specs[i % 2]) for i in range(rows)]
    _ready(manager, *requests)
    so = _step([r.request_id for r in requests], requests)
    manager.fill_bitmask(so)
    assert so.structured_output_request_ids == [r.request_id for r in requests]
    x = backends["xgrammar"]
    expected = [_mask(x, x.matcher(x.compile(spec))) for spec in specs]
    assert expected[0] != expected[1]
    for i in range(rows):
        assert _allowed(so.grammar_bitmask[i]) == expected[i % 2], i
    manager.shutdown()


def test_auto_takes_xgrammar_where_it_builds_the_constraint_else_llguidance(monkeypatch):
    auto = StructuredOutputsConfig()
    assert auto.backend == "auto"
    assert auto.backend_for(StructuredOutputsParams(json={"type": "object"})) == "xgrammar"
    assert auto.backend_for(StructuredOutputsParams(regex="[0-9]+")) == "xgrammar"
    # what xgrammar cannot take: whitespace_pattern, Lark (llguidance's), a spec it fails to build
    assert auto.backend_for(StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=" ?")) == "guidance"
    assert auto.backend_for(StructuredOutputsParams(grammar="%llguidance {}\nstart: \"a\"")) == "guidance"
    assert auto.backend_for(StructuredOutputsParams(regex="[0-9")) == "guidance"  # llguidance names the error
    assert auto.backend_for(StructuredOutputsParams(grammar='root ::= "a"+')) == "xgrammar"  # GBNF
    assert auto.backend_for(StructuredOutputsParams(grammar='start: "a"+')) == "xgrammar"  # plain Lark
    guidance = StructuredOutputsConfig(backend="guidance")
    assert guidance.backend_for(StructuredOutputsParams(regex="[0-9]+")) == "guidance"
    monkeypatch.setattr(xgrammar_backend, "available", lambda: False)
    assert auto.backend_for(StructuredOutputsParams(regex="[0-9]+")) == "guidance"
    with pytest.raises(ValueError, match="needs the xgrammar package"):
        StructuredOutputsConfig.parse({"backend": "xgrammar"})


def test_xgrammar_refuses_what_it_cannot_express_by_name():
    with pytest.raises(ValueError, match="invalid structured_outputs.grammar: the grammar uses llguidance's Lark"):
        xgrammar_backend.grammar(StructuredOutputsParams(grammar="%llguidance {}\nstart: \"a\""))
    with pytest.raises(ValueError, match="invalid structured_outputs.regex: .*Unclosed"):
        xgrammar_backend.grammar(StructuredOutputsParams(regex="[0-9"))
    with pytest.raises(ValueError, match="invalid structured_outputs.json: .*objekt"):
        xgrammar_backend.grammar(StructuredOutputsParams(json={"type": "objekt"}))


@pytest.mark.parametrize("value, says", [
    ({"backend": "outlines"}, "backend 'outlines' is not supported"),
    ({"backend": "lm-format-enforcer"}, "is not supported"),
    ({"backend": "xgrammer"}, "backend must be one of"),
    ({"backend": "auto", "disable_fallback": True}, "unknown key(s) ['disable_fallback']"),
    ({"disable_any_whitespace": "yes"}, "disable_any_whitespace'] must be true or false"),
    ("{backend: auto}", "must be a JSON object"),
    (["auto"], "must be a dict"),
])
def test_bad_configs_name_the_problem(value, says):
    with pytest.raises(ValueError) as info:
        StructuredOutputsConfig.parse(value)
    assert says in str(info.value)


def test_engine_wide_options_apply_to_every_request():
    config = StructuredOutputsConfig.parse('{"backend": "guidance", "disable_any_whitespace": true}')
    spec = config.apply(StructuredOutputsParams(json={"type": "object"}))
    assert spec.disable_any_whitespace and not spec.disable_additional_properties


def test_llm_and_cli_take_structured_outputs_config(monkeypatch):
    import argparse

    from moe import LLM, SamplingParams
    from moe.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", "tiny-qwen3-moe", "--structured-outputs-config", '{"backend": "guidance"}']))
    assert args.structured_outputs.backend == "guidance"
    with pytest.raises(ValueError, match="structured_outputs_config backend must be one of"):
        LLM("tiny-qwen3-moe", device="cpu", structured_outputs_config={"backend": "nope"})
    compiled = []
    real = xgrammar_backend.XgrammarBackend.compile
    monkeypatch.setattr(xgrammar_backend.XgrammarBackend, "compile",
                        lambda self, p: compiled.append(p.kind) or real(self, p))
    llm = LLM("tiny-qwen3-moe", device="cpu", structured_outputs_config={"backend": "xgrammar"})
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    out = llm.generate(["Hi"], params, use_tqdm=False)[0].outputs[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
    assert compiled == ["choice"], "the engine core compiled the request with xgrammar"
    llm.shutdown()
