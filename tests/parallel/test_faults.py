"""Failures: sizes that do not divide raise ValueError before any process starts; a worker that
dies makes the engine raise naming the rank, quickly, and leaves no process behind."""
from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest

from moe import LLM, SamplingParams
from tests.factories import make_qwen3_moe_checkpoint


def _workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("moe-worker")]


def assert_workers_gone(pids: list[int], within_s: float = 10.0) -> None:
    """No moe worker child is left, and none of `pids` exists, within `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _workers()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size=3 does not divide num_hidden_layers=4"),
    (dict(data_parallel_size=3, enable_expert_parallel=True), "data_parallel_size=3 x tensor_parallel_size=1"),
    (dict(all2all_backend="nccl"), "all2all_backend must be one of"),
    (dict(expert_placement_strategy="random"), "expert_placement_strategy must be one of"),
    (dict(distributed_executor_backend="uni", tensor_parallel_size=2), "distributed_executor_backend='uni'"),
])
def test_sizes_that_do_not_divide(parallel_ckpt, kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        LLM(parallel_ckpt, dtype="float32", device="cpu", **kwargs)
    assert not _workers()


def test_vocab_and_expert_sizes(tmp_path):
    path = make_qwen3_moe_checkpoint(str(tmp_path / "odd"), vocab_size=511, num_experts=6, with_tokenizer=False)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide vocab_size=511"):
        LLM(path, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size=4 x tensor_parallel_size=1"):
        LLM(path, device="cpu", data_parallel_size=4, enable_expert_parallel=True)
    assert not _workers()


def test_killed_worker_is_reported_by_rank(parallel_ckpt):
    llm = LLM(parallel_ckpt, dtype="float32", device="cpu", tensor_parallel_size=2)
    pids = llm.llm_engine.executor.worker_pids
    killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    start = time.monotonic()
    killer.start()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, params, use_tqdm=False)
    assert time.monotonic() - start < 30
    # The engine stays failed (no hang on the next call), and no worker survives the LLM.
    with pytest.raises(RuntimeError, match="worker rank 1"):
        llm.generate([{"prompt_token_ids": [1, 2]}], params, use_tqdm=False)
    del llm
    gc.collect()
    assert_workers_gone(pids)


def test_deleting_the_llm_stops_its_workers(parallel_ckpt):
    llm = LLM(parallel_ckpt, dtype="float32", device="cpu", data_parallel_size=2)
    pids = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert_workers_gone(pids)


def test_context_manager_stops_its_workers(parallel_ckpt):
    with LLM(parallel_ckpt, dtype="float32", device="cpu", tensor_parallel_size=2) as llm:
        pids = llm.llm_engine.executor.worker_pids
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    assert_workers_gone(pids)  # shutdown() returned: the workers are going or gone


def test_bench_parallel_decode_smoke():
    """benchmarks/bench_parallel_decode.py end to end on tiny shapes (2 CPU processes)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_parallel_decode.py"), "--smoke",
                           "--layouts", "dp2-ep"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["layout"], r["batch"]) for r in rows] == [("dp2-ep", 1), ("dp2-ep", 4)]
    assert all(r["decode_step_ms_median"] > 0 for r in rows)
