"""Structured outputs under the engine's other modes: async scheduling (a structured request skips
the step behind its own token in flight; the others keep the pipeline), preemption (RECOMPUTE keeps
the output tokens, so the matcher needs no rollback), aborts, a grammar still compiling while other
requests run, and worker processes (TP=2 on gloo: the bitmask travels pickled in the
SchedulerOutput). Each must give the synchronous in-process engine's tokens."""
from __future__ import annotations

import random
import threading

import pytest

from moe import SamplingParams, StructuredOutputsParams
from tests.structured_output.helpers import check_schema, completions, json_params, tiny_llm


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(rng.randrange(3, 40))]} for _ in range(n)]


def _mixed_params(n: int) -> list[SamplingParams]:
    """Structured (greedy and seeded) and plain requests, interleaved."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append(SamplingParams(temperature=0.0, max_tokens=20 + i))
        elif i % 3 == 1:
            out.append(json_params())
        else:
            out.append(json_params(temperature=0.9, seed=i))
    return out


def _tokens(llm, prompts, params):
    return [(list(o[0].token_ids), o[0].finish_reason) for o in completions(llm, prompts, params)]


@pytest.fixture(scope="module")
def reference():
    prompts, params = _prompts(9), _mixed_params(9)
    llm = tiny_llm(max_model_len=256, async_scheduling=False)
    outs = completions(llm, prompts, params)
    for p, o in zip(params, outs):
        if p.structured_outputs is not None:
            check_schema(o[0].text)
    return prompts, params, [(list(o[0].token_ids), o[0].finish_reason) for o in outs]


def test_async_scheduling_gives_the_synchronous_tokens(reference):
    prompts, params, want = reference
    llm = tiny_llm(max_model_len=256, async_scheduling=True, max_num_batched_tokens=64)
    assert llm.llm_engine.core.async_scheduling
    assert _tokens(llm, prompts, params) == want


def test_async_structured_rows_decode_every_step(reference, monkeypatch):
    """In-process async scheduling schedules a structured row with its token in flight and fills its
    mask once that token is consumed, before the step samples: the same tokens as synchronous steps,
    and a step per token rather than every other step."""
    from moe.structured_output.manager import StructuredOutputManager

    prompts, params, want = reference
    deferred = []
    real = StructuredOutputManager.fill_deferred
    monkeypatch.setattr(StructuredOutputManager, "fill_deferred",
                        lambda self, so: deferred.append(len(so.deferred_grammar_ids)) or real(self, so))
    llm = tiny_llm(max_model_len=256, async_scheduling=True)
    core = llm.llm_engine.core
    assert core.scheduler.config.defer_grammar_masks
    steps = core.num_steps
    assert _tokens(llm, prompts, params) == want
    longest = max(len(tokens) for tokens, _ in want)
    assert deferred and max(deferred) > 1, "structured rows were scheduled with their token in flight"
    # Prefill, the decode steps, and the last step's collection; every other step would be ~2x longest.
    assert core.num_steps - steps <= longest + 4, (core.num_steps - steps, longest)


def test_preemption_under_a_tiny_kv_cache_keeps_the_outputs(reference):
    prompts, params, want = reference
    for async_scheduling in (False, True):
        llm = tiny_llm(max_model_len=128, num_gpu_blocks_override=10, max_num_seqs=8,
                       async_scheduling=async_scheduling)
        assert _tokens(llm, prompts, params) == want
        assert llm.llm_engine.core.scheduler.num_preemptions > 0, "the cache is small enough to preempt"


def test_a_request_waits_for_its_grammar_while_others_run(monkeypatch):
    """A slow compilation holds back only its own request (WAITING_FOR_FSM); the plain request
    next to it finishes first, then the structured one runs once its grammar is ready."""
    import moe.structured_output.manager as manager_mod

    gate = threading.Event()
    real = manager_mod._compile

    def slow(tokenizer_future, grammar):
        gate.wait(30)
        return real(tokenizer_future, grammar)

    monkeypatch.setattr(manager_mod, "_compile", slow)
    engine = tiny_llm(max_model_len=256).llm_engine
    engine.add_request("structured", "Hello", json_params())
    engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=6))
    finished = []
    for _ in range(30):
        finished += [o.request_id for o in engine.step()]
        if "plain" in finished:
            break
    assert finished == ["plain"], "the plain request ran while the grammar compiled"
    assert engine.core.scheduler.requests["structured"].status.value == "waiting_for_fsm"
    gate.set()
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    check_schema(outs["structured"].outputs[0].text)


def test_abort_and_a_step_in_flight_forget_the_matcher():
    engine = tiny_llm(max_model_len=256, async_scheduling=True).llm_engine
    for i in range(3):
        engine.add_request(f"r{i}", "Hello there", json_params(temperature=1.0, seed=i))
    for _ in range(4):
        engine.step()
    engine.abort_request("r1")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert set(outs) == {"r0", "r2"}
    for o in outs.values():
        check_schema(o.outputs[0].text)
    assert "r1" not in engine.core.structured and not engine.core.structured._sequences


def test_tensor_parallel_worker_processes(reference):
    prompts, params, want = reference
    llm = tiny_llm(max_model_len=256, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert _tokens(llm, prompts[:6], params[:6]) == want[:6]
    finally:
        llm.llm_engine.shutdown()


def test_min_tokens_and_ignore_eos_do_not_break_a_grammar():
    """min_tokens bans EOS early (the grammar allows it only at its end); ignore_eos keeps EOS a
    plain token: either way the request finishes when its grammar is complete."""
    llm = tiny_llm(max_model_len=256)
    regex = StructuredOutputsParams(regex="[a-d]{2,8}")
    for extra in (dict(min_tokens=3), dict(ignore_eos=True)):
        (out,), = completions(llm, ["Hello"], SamplingParams(temperature=0.0, max_tokens=20,
                                                              structured_outputs=regex, **extra))
        assert out.finish_reason == "stop" and 2 <= len(out.text) <= 8 and set(out.text) <= set("abcd")
