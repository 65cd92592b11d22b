"""Async scheduling (`async_scheduling=True`): step N+1 is scheduled and launched before step N's
tokens reach the host. Every output must equal the synchronous engine's: greedy and seeded
sampling, logprobs, chunked prefill, prefix-cache hits, stop tokens, max_tokens / max_model_len,
penalties (which wait for the step in flight), preemption, aborts and failed steps.

Tokens and finish reasons are compared exactly, logprobs to 1e-4: a request that stops on a token
still takes a seat in the step already scheduled behind it, so a waiting request may join a step
later than in synchronous mode, and another batch composition rounds fp32 sums differently (in
the 6th digit here)."""
from __future__ import annotations

import random

import pytest

from moe import LLM, SamplingParams
from moe.config import EngineArgs
from scheduler import Request, Scheduler, SchedulerConfig


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 512) for _ in range(shared)]
    return [prefix + [rng.randrange(1, 512) for _ in range(rng.randrange(2, 50))] for _ in range(n)]


def _generate(async_scheduling: bool, prompts, params, **engine_args):
    llm = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=async_scheduling, **engine_args)
    assert llm.llm_engine.core.async_scheduling is async_scheduling
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             None if o.outputs[0].logprobs is None else
             [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
            for o in outs]


def _same(prompts, params, **engine_args):
    want = _generate(False, prompts, params, **engine_args)
    got = _generate(True, prompts, params, **engine_args)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        assert (g[3] is None) == (w[3] is None)
        for step_g, step_w in zip(g[3] or [], w[3] or []):
            assert [t for t, _ in step_g] == [t for t, _ in step_w]
            assert [lp for _, lp in step_g] == pytest.approx([lp for _, lp in step_w], abs=1e-4)


def test_greedy_and_seeded_sampling_with_logprobs_and_chunked_prefill():
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.9, seed=i, max_tokens=4 + 3 * i,
                             logprobs=2) for i in range(len(prompts))]
    _same(prompts, params, max_num_batched_tokens=48, max_model_len=256)


def test_prefix_cache_hits_and_block_boundaries():
    """Shared prefixes hit the cache; generated tokens cross block boundaries (16 tokens), where a
    block filled by a placeholder is registered only once its token is known; a second round of
    prompts extended by the first round's outputs hits those generated blocks."""
    prompts = _prompts(6, seed=1, shared=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def two_rounds(async_scheduling):
        llm = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=async_scheduling, enable_prefix_caching=True,
                  max_model_len=256)
        first = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                    params, use_tqdm=False)]
        again = llm.generate([{"prompt_token_ids": p + t[:36]} for p, t in zip(prompts, first)],
                             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        return first, [list(o.outputs[0].token_ids) for o in again], llm.llm_engine.core.scheduler.kv.prefix_cache_hits

    want, got = two_rounds(False), two_rounds(True)
    assert got[:2] == want[:2]
    assert got[2] == want[2] > 6 * 48, "the second round hits the shared prefix and generated blocks"


def test_stops_lengths_and_penalties():
    prompts = _prompts(8, seed=2)
    greedy = _generate(False, prompts, SamplingParams(temperature=0.0, max_tokens=12))
    stop_on = [toks[3] for toks, *_ in greedy]  # a token each greedy output emits: it stops there
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_on[0]]),
              SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_on[1]], min_tokens=6),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=0.0, max_tokens=200),  # capped by max_model_len
              SamplingParams(temperature=0.7, seed=3, max_tokens=10, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=9, presence_penalty=0.5, frequency_penalty=0.2),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, logprobs=0)]
    _same(prompts, params, max_model_len=96)


def test_preemption_under_a_small_kv_cache():
    prompts = _prompts(12, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=30)
    _same(prompts, params, num_gpu_blocks_override=12, max_model_len=128, max_num_seqs=8)
    llm = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=True, num_gpu_blocks_override=12,
              max_model_len=128, max_num_seqs=8)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0, "the cache is small enough to preempt"


def test_abort_while_a_step_is_in_flight():
    engine = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=True).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30)
    for i, p in enumerate(_prompts(3, seed=4)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    for _ in range(4):
        engine.step()
    assert engine.core._in_flight is not None
    engine.abort_request(["r1"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert set(finished) == {"r0", "r2"} and all(n == 30 for n in finished.values())
    assert not engine.core.scheduler.requests and engine.core._in_flight is None


def test_aborting_every_request_leaves_the_engine_idle():
    """Aborting all that runs collects the step in flight: nothing is unfinished (as after a
    synchronous step), and the next request gets the synchronous engine's tokens."""
    prompts = _prompts(2, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = [t for t, *_ in _generate(False, prompts[1:], params)]
    engine = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=True).llm_engine
    engine.add_request("a", {"prompt_token_ids": prompts[0]}, SamplingParams(n=2, temperature=1.0, seed=3))
    engine.step()
    engine.step()
    assert engine.core._in_flight is not None
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.core._in_flight is None
    assert engine.core.scheduler.kv.usage() == 0
    engine.add_request("b", {"prompt_token_ids": prompts[1]}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_failed_step_is_recovered(monkeypatch):
    """A step whose launch raises is undone and its request blamed; the step in flight before it
    completes, and the other requests finish with the synchronous engine's tokens."""
    prompts = _prompts(3, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = [t for t, *_ in _generate(False, prompts, params)]
    llm = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=True)
    runner = llm.llm_engine.core.executor.runner
    real_launch, calls = runner.launch, []

    def launch(so, prev=None, dummy=False):
        calls.append(1)
        if len(calls) == 5:
            from moe.errors import StepFailure
            raise StepFailure("injected", request_ids=["1"])
        return real_launch(so, prev=prev, dummy=dummy)
    monkeypatch.setattr(runner, "launch", launch)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["1"].outputs[0].finish_reason == "error" and final["1"].error
    assert [list(final[r].outputs[0].token_ids) for r in ("0", "2")] == [want[0], want[2]]


def test_scheduler_placeholders():
    """A step that samples gives the request a placeholder; the next schedule computes it before its
    token is known; the token's arrival consumes it; a request whose in-flight tokens finish it is
    not scheduled again."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                  num_blocks=32, async_scheduling=True))
    s.add_request(Request("a", [1, 2, 3], max_tokens=2))
    so1 = s.schedule()
    req = s.requests["a"]
    assert so1.num_scheduled_tokens == {"a": 3} and req.num_output_placeholders == 1
    so2 = s.schedule()  # step 1's token still in flight
    assert so2.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    assert req.num_computed_tokens == 4 and len(req.all_token_ids) == 3
    assert s.schedule().num_scheduled_tokens == {}, "max_tokens=2 is reached by the tokens in flight"
    s.update_from_output(so1, {"a": [7]})
    assert req.num_output_placeholders == 1 and req.all_token_ids == [1, 2, 3, 7]
    out = s.update_from_output(so2, {"a": [8]})
    assert out[0].finish_reason == "length" and "a" not in s.requests


def test_default_is_synchronous_on_the_cpu_and_flag_turns_it_on():
    # On the CPU the step blocks the host anyway: the default (None) leaves steps synchronous.
    assert EngineArgs(model="x").async_scheduling is None
    llm = LLM("tiny-qwen3-moe", device="cpu")
    assert llm.llm_engine.core.async_scheduling is False
    llm.llm_engine.core.shutdown()


def test_falls_back_to_synchronous_steps_where_unsupported(caplog):
    llm = LLM("tiny-qwen3-moe", device="cpu", async_scheduling=True, pipeline_parallel_size=2)
    assert llm.llm_engine.core.async_scheduling is False
    assert any("async_scheduling needs" in r.getMessage() for r in caplog.records)
    llm.llm_engine.core.shutdown()


def test_tensor_parallel_worker_processes():
    """TP=2 in worker processes: the driver sends step N+1 before N's reply and the TP ranks pass
    the sampled tokens among themselves. Same tokens and logprobs as synchronous steps; an executor
    call between steps (the expert-load snapshot) reads the step in flight's replies first; an abort
    with a step in flight leaves the engine idle. Off by default (not yet measured on GPUs)."""
    prompts = _prompts(6, seed=7)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + 3 * i, logprobs=1)
              for i in range(6)]
    want = _generate(False, prompts, params, tensor_parallel_size=2, max_num_seqs=4)
    assert LLM("tiny-qwen3-moe", device="cpu", tensor_parallel_size=2).llm_engine.core.async_scheduling is False
    llm = LLM("tiny-qwen3-moe", device="cpu", tensor_parallel_size=2, max_num_seqs=4, async_scheduling=True)
    engine = llm.llm_engine
    assert engine.core.async_scheduling is True
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in got] == [w[:2] for w in want]
    for o, w in zip(got, want):
        lps = [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs]
        for a, b in zip(lps, w[3]):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b))
    engine.add_request("x", {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()
    engine.step()
    assert engine.core._in_flight is not None
    assert engine.core.executor.expert_load_snapshot() is not None  # replies of the step in flight kept
    engine.step()
    engine.abort_request("x")
    assert not engine.has_unfinished_requests() and engine.core._in_flight is None
    again = llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)[0].outputs[0]
    assert (list(again.token_ids), again.finish_reason) == want[0][:2]  # seeded: the same tokens alone
    engine.core.shutdown()


@pytest.mark.parametrize("flag", ["--async-scheduling"])
def test_cli_flag(flag):
    import argparse

    from moe.config import EngineArgs
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--model", "x", flag]).async_scheduling is True
    assert parser.parse_args(["--model", "x", "--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args(["--model", "x"]).async_scheduling is None


@pytest.mark.parametrize("seed", [11, 12])
def test_random_workloads_equal_synchronous_steps(seed):
    """Random prompts (some sharing prefixes), lengths, sampling settings and engine limits small
    enough to chunk prefills and preempt."""
    rng = random.Random(seed)
    prompts = _prompts(14, seed=seed, shared=rng.choice([0, 20]))
    params = [SamplingParams(temperature=rng.choice([0.0, 0.0, 0.7]), seed=rng.randrange(100),
                             top_k=rng.choice([0, 20]), max_tokens=rng.randrange(1, 40),
                             logprobs=rng.choice([None, 1]), ignore_eos=rng.random() < 0.5,
                             repetition_penalty=rng.choice([1.0, 1.0, 1.0, 1.2]))
              for _ in prompts]
    _same(prompts, params, max_num_batched_tokens=rng.choice([32, 64, 512]), max_num_seqs=rng.choice([3, 8]),
          num_gpu_blocks_override=rng.choice([16, 64]), enable_prefix_caching=rng.random() < 0.5,
          max_model_len=128)


def test_step_buffer_path_equals_synchronous_steps(monkeypatch):
    """The GPU's input path, eagerly on the CPU: step inputs through the step buffers, pending input
    ids (`pending_src`) resolved from the runner rows' last sampled tokens, with preemption and
    chunked prefill."""
    from tests.moe.step_buffer_path import force_step_buffers
    resolved = force_step_buffers(monkeypatch)
    rng = random.Random(5)
    prompts = _prompts(14, seed=5, shared=20)
    params = [SamplingParams(temperature=rng.choice([0.0, 0.7]), seed=rng.randrange(100),
                             max_tokens=rng.randrange(1, 40), ignore_eos=True, logprobs=1) for _ in prompts]
    _same(prompts, params, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128, num_gpu_blocks_override=16)
    assert sum(resolved) > 20  # async steps read pending ids through the buffers


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_a_step_launch_never_waits_for_the_device(enforce_eager, family, tmp_path):
    """With async scheduling the host prepares step N+1 while the GPU runs step N, so launching a
    step (its inputs, the forward, sampling) must never synchronize with the stream: not in
    decode, mixed or prefill steps, graphs or eager, for greedy and sampled rows, top-k / top-p,
    penalties, min_tokens and logprobs, with GQA or MLA (DeepSeek-V3) attention. torch's sync
    debug mode raises at the first synchronizing call inside a launch."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = "tiny-qwen3-moe"
    if family == "deepseek_v3":
        from tests.factories_deepseek import make_deepseek_v3_checkpoint
        model = make_deepseek_v3_checkpoint(str(tmp_path / "ds"))
    prompts = [{"prompt_token_ids": p} for p in _prompts(7, seed=11)] + [{"prompt_token_ids": list(range(1, 90))}]
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3, max_tokens=7),
              SamplingParams(temperature=0.0, min_tokens=4, max_tokens=6, stop_token_ids=[5]),
              SamplingParams(temperature=0.0, logprobs=2, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    with LLM(model, device="cuda", dtype="float32", enforce_eager=enforce_eager, max_num_seqs=4,
             max_num_batched_tokens=48, gpu_memory_utilization=0.2) as llm:
        assert llm.llm_engine.core.async_scheduling
        llm.generate(prompts, params, use_tqdm=False)  # kernels compile outside the strict runs
        runner = llm.llm_engine.executor.runner
        real, launched = runner.launch, []

        def strict(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return real(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                launched.append(1)
        runner.launch = strict
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(launched) > 10
    assert [len(o.outputs[0].token_ids) for o in outs][:3] == [9, 10, 8]
