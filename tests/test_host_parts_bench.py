"""benchmarks/gpu_engine_bench.py's host_parts run on the CPU (the tiny model): every part is
timed in both kinds of step, the parts nest as documented, and the timers are gone afterwards
(a second run sees the engine as the first did)."""
from __future__ import annotations

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_engine_bench as bench  # noqa: E402

from moe import LLM  # noqa: E402
import moe.worker.model_runner as mr  # noqa: E402


def test_host_parts_times_each_part_and_unwraps(monkeypatch):
    prompts = bench._prompts
    monkeypatch.setattr(bench, "_prompts", lambda n, length, seed=0, vocab=0: prompts(n, length, seed, vocab=500))
    llm = LLM("tiny-qwen3-moe", device="cpu", enable_prefix_caching=False, max_num_seqs=8, max_model_len=256)
    engine = llm.llm_engine
    build, upload, step = mr.StepBatch.__dict__["build"], mr.upload, type(engine).step
    for _ in range(2):  # the same request ids' prefixes twice: nothing left over from the first run
        out = bench.host_parts(llm, num_decodes=4, chunk=8, prompt_len=8, steps=3)
        assert out["steps_each"] == 3
        for kind in ("decode", "mixed"):
            parts = out[kind]
            for name in ("engine_step", "core_step", "output_side", "schedule", "update_from_output", "launch",
                         "batch_build", "sampling_inputs", "sample_launch", "logits_launch"):
                assert parts[name] > 0, (kind, name)
            assert parts["engine_step"] >= parts["core_step"] >= parts["launch"] >= parts["batch_build"]
            assert parts["gc"]["passes"] >= parts["gc"]["full_passes"] >= 0
            assert parts["gc"]["max_ms"] <= parts["gc"]["total_ms"]
        assert mr.StepBatch.__dict__["build"] is build and mr.upload is upload
        assert "step" not in engine.__dict__ or engine.__dict__["step"].__func__ is step
    assert not engine.has_unfinished_requests()
    assert all(cb.__name__ != "on_gc" for cb in gc.callbacks)  # the pause timer is gone too


def test_host_profile_lists_the_functions_of_both_kinds_of_step(monkeypatch):
    prompts = bench._prompts
    monkeypatch.setattr(bench, "_prompts", lambda n, length, seed=0, vocab=0: prompts(n, length, seed, vocab=500))
    llm = LLM("tiny-qwen3-moe", device="cpu", enable_prefix_caching=False, max_num_seqs=8, max_model_len=256)
    out = bench.host_profile(llm, num_decodes=4, chunk=8, prompt_len=8, steps=3)
    for kind in ("decode", "mixed"):
        own, cumulative = out[kind]["by_own_ms"], out[kind]["by_cumulative_ms"]
        assert own and cumulative and all(len(row) == 4 for row in own + cumulative)
        assert [r[2] for r in own] == sorted((r[2] for r in own), reverse=True)
        assert [r[3] for r in cumulative] == sorted((r[3] for r in cumulative), reverse=True)
        assert any(r[0].startswith("llm_engine.py:") and r[0].endswith("(step)") for r in cumulative), kind
    assert not llm.llm_engine.has_unfinished_requests()


def test_mixed_traffic_reports_the_floor_of_the_steps_it_ran(monkeypatch):
    """mixed_traffic on the CPU (the tiny model): beside the ideal schedule's floor (full batches), the sum of the
    floors of the steps the engine ran, per kind and in all, and their ratio."""
    llm = LLM("tiny-qwen3-moe", device="cpu", enable_prefix_caching=False, max_num_seqs=4, max_model_len=256)
    requests = bench.random_token_requests
    monkeypatch.setattr(bench, "random_token_requests",
                        lambda n, i, o, vocab, seed, ratio: requests(n, i, o, 500, seed, ratio))
    out = bench.mixed_traffic(llm, num_prompts=10, input_len=24, output_len=6, warmup=2)
    kinds = [r for r in out["steps"].values() if "floor_s" in r]
    assert kinds and all(r["floor_s"] > 0 for r in kinds)
    assert abs(out["steps_floor_s"] - sum(r["floor_s"] for r in kinds)) < 1e-3
    assert out["floor_s"] > 0 and abs(out["floor_over_steps_floor"] - out["floor_s"] / out["steps_floor_s"]) < 1e-9
    # the CPU has no CUDA graphs: every step of every kind ran its forward eagerly
    assert all(r["eager_steps"] == r["steps"] for r in kinds)
    assert "_forward" not in llm.llm_engine.executor.runner.__dict__  # unwrapped
    assert not llm.llm_engine.has_unfinished_requests()


def test_start_decoding_leaves_every_request_its_tokens_after_a_long_prefill(monkeypatch):
    """The prompts take several steps to prefill (a small token budget), the first ones decoding meanwhile: once
    all decode, each still has max_tokens to go, so a timed window of that many steps holds every request."""
    prompts = bench._prompts
    monkeypatch.setattr(bench, "_prompts", lambda n, length, seed=0, vocab=0: prompts(n, length, seed, vocab=500))
    llm = LLM("tiny-qwen3-moe", device="cpu", enable_prefix_caching=False, max_num_seqs=8, max_model_len=256,
              max_num_batched_tokens=32)
    engine = llm.llm_engine
    bench._start_decoding(llm, 8, 24, max_tokens=4)
    assert len(engine.scheduler.running) == 8 and not engine.scheduler.waiting
    for _ in range(4):
        engine.step()
        assert len(engine.scheduler.running) == 8
    while engine.has_unfinished_requests():
        engine.step()
