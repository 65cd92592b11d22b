"""Structured outputs through LLM.generate on the random-weight tiny model: only the grammar makes
its output a schema-valid JSON value, a regex match, one of the choices or a grammar's sentence.
Each kind finishes with "stop" when its grammar is complete; other requests of a batch are
untouched; a spec that cannot compile is a ValueError naming it, and the engine goes on. On llguidance
and on xgrammar."""
from __future__ import annotations

import json
import re

import pytest

from moe import SamplingParams, StructuredOutputsParams
from tests.structured_output.helpers import check_schema, completions, json_params, tiny_llm

PROMPTS = ["Hello", "The quick brown fox", "Numbers: 0 1 2", "Mixture-of-experts models route"]


@pytest.fixture(scope="module", params=["guidance", "xgrammar"])
def llm(request):
    """The same tests on each grammar library (structured_outputs_config's backend)."""
    return tiny_llm(max_model_len=256, structured_outputs_config={"backend": request.param})


def _so(**kw) -> SamplingParams:
    spec = {k: kw.pop(k) for k in list(kw) if k in StructuredOutputsParams.__dataclass_fields__}
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 40)
    return SamplingParams(structured_outputs=StructuredOutputsParams(**spec), **kw)


def test_json_schema_outputs_are_valid_and_finish_at_the_closing_brace(llm):
    for (out,) in completions(llm, PROMPTS, json_params()):
        assert out.finish_reason == "stop" and out.stop_reason is None
        check_schema(out.text)
        assert out.text.endswith("}"), "the request ends with the grammar, at its last token"


def test_unconstrained_output_is_not_json(llm):
    """The test's edge: without the grammar the random model does not write the schema's JSON."""
    for (out,) in completions(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=40)):
        with pytest.raises((ValueError, AssertionError)):
            check_schema(out.text)


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (_so(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (_so(choice=["alpha", "beta", "gamma delta"]), lambda t: t in ("alpha", "beta", "gamma delta")),
        # Lark
        (_so(grammar='start: "(" item ("," item)* ")"\nitem: /[a-c]/ | NUMBER\nNUMBER: /[0-9]{1,2}/'),
         lambda t: re.fullmatch(r"\(([a-c]|[0-9]{1,2})(,([a-c]|[0-9]{1,2}))*\)", t)),
        # GBNF / EBNF
        (_so(grammar='root ::= "ans=" [xyz] [0-9]'), lambda t: re.fullmatch(r"ans=[xyz][0-9]", t)),
    ]
    for params, valid in cases:
        outs = completions(llm, PROMPTS[:2], params)
        for (out,) in outs:
            assert valid(out.text), (params.structured_outputs, out.text)
            assert out.finish_reason == "stop", (params.structured_outputs, out.text, out.finish_reason)
    # Any JSON object: a random model may write one key forever; those that end are objects.
    params = _so(json_object=True, disable_any_whitespace=True, max_tokens=60, n=4, temperature=1.0, seed=0)
    outs = [o for seqs in completions(llm, PROMPTS, params) for o in seqs]
    assert all(o.text.startswith("{") for o in outs)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(o.text), dict) for o in done)


def test_n2_with_a_seed_is_reproducible_and_each_sequence_valid(llm):
    params = json_params(n=2, temperature=1.0, seed=7)
    first = completions(llm, PROMPTS[:2], params)
    again = completions(llm, PROMPTS[:2], params)
    assert [[o.token_ids for o in outs] for outs in first] == [[o.token_ids for o in outs] for outs in again]
    for outs in first:
        assert len(outs) == 2
        for out in outs:
            check_schema(out.text)
    assert any(outs[0].token_ids != outs[1].token_ids for outs in first), "the two sequences sample apart"


def test_unconstrained_requests_of_a_mixed_batch_are_untouched(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = completions(llm, PROMPTS, plain)
    mixed = completions(llm, PROMPTS + PROMPTS, [plain] * len(PROMPTS) + [json_params()] * len(PROMPTS))
    assert [o[0].token_ids for o in mixed[:len(PROMPTS)]] == [o[0].token_ids for o in alone]
    for (out,) in mixed[len(PROMPTS):]:
        check_schema(out.text)


def test_logprobs_are_those_of_the_masked_distribution(llm):
    """As vLLM: the mask is applied to the logits before the logprobs are taken, so every token of
    the top-k the grammar forbids has -inf, and the tokens that start a choice (any tokenization of
    it) take all the mass."""
    (out,), = completions(llm, ["Hello"], _so(choice=["alpha", "beta"], logprobs=8))
    first = out.logprobs[0]
    allowed = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    assert 1 <= len(allowed) < len(first), first
    assert all("alpha".startswith(first[t].decoded_token) or "beta".startswith(first[t].decoded_token)
               for t in allowed), first
    assert sum(2.718281828 ** first[t].logprob for t in allowed) == pytest.approx(1.0, abs=1e-4)


def test_streamed_text_grows_to_the_final_value(llm):
    engine = llm.llm_engine
    engine.add_request("s", "Hello", json_params())
    seen = []
    while engine.has_unfinished_requests():
        for parent in engine.step_detailed().updated:
            seen.append(parent.to_output().outputs[0].text)
    assert len(seen) > 5 and all(b.startswith(a) for a, b in zip(seen, seen[1:]))
    check_schema(seen[-1])


@pytest.mark.parametrize("spec, field, says", [  # says: llguidance's words | xgrammar's
    (dict(json={"type": "objekt"}), "json", "objekt"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}), "json", "nowhere"),
    (dict(regex="[0-9"), "regex", r"unclosed character class|Unclosed '\['"),
    (dict(grammar="start: missing_rule"), "grammar", "missing_rule"),
    (dict(grammar='root ::= "a'), "grammar", "GBNF|EBNF lexer error.* string literal"),
    (dict(structural_tag='{"type": "structural_tag", "format": {}}'), "structural_tag", "only the form"),
])
def test_a_bad_spec_is_a_value_error_naming_it_and_the_engine_goes_on(llm, spec, field, says):
    with pytest.raises(ValueError, match=f"structured_outputs.{field}") as info:
        llm.generate(["Hello"], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert re.search(says, str(info.value)), str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()
    (out,), = completions(llm, ["Hello"], _so(regex="ok|no"))
    assert out.text in ("ok", "no")


def test_structural_tag_requests_run(llm):
    """Compiles and serves (the random model rarely writes a trigger; test_manager.py checks the
    segments' constraint on a matcher)."""
    tag = {"structures": [{"begin": "<f=x>", "schema": {"type": "object", "properties": {"v": {"enum": [1, 2]}},
                                                         "required": ["v"], "additionalProperties": False},
                           "end": "</f>"}],
           "triggers": ["<f="]}
    (out,), = completions(llm, ["Hello"], _so(structural_tag=json.dumps(tag), max_tokens=30))
    for segment in re.findall(r"<f=x>(.*?)</f>", out.text, flags=re.S):
        assert json.loads(segment)["v"] in (1, 2)


def test_a_grammar_compiles_once_for_many_requests(llm):
    manager = llm.llm_engine.core.structured
    before = manager.num_compiled
    params = _so(regex=r"[a-e]{4}")
    completions(llm, PROMPTS, params)
    completions(llm, PROMPTS, params)
    assert manager.num_compiled == before + 1
