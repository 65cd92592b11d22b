"""Worker faults of a parallel layout are reported with the rank to blame: a frozen (SIGSTOP)
worker after the step timeout, and a script without a main guard at start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moe import LLM, SamplingParams
from moe.worker.parallel_executor import DEFAULT_STEP_TIMEOUT_S, WorkerFailure, describe_silent_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_silent_ranks_are_told_apart_by_process_state():
    stopped = subprocess.Popen(["sleep", "30"])
    waiting = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        msg = describe_silent_ranks({0: waiting.pid, 1: stopped.pid})
        assert msg.startswith(f"worker rank 1 (pid {stopped.pid}) did not answer: it is stopped (SIGSTOP")
        assert "rank(s) [0] are waiting" in msg
        os.kill(stopped.pid, signal.SIGCONT)
        time.sleep(0.2)
        assert describe_silent_ranks({0: waiting.pid, 1: stopped.pid}) == "worker rank(s) [0, 1] did not answer"
    finally:
        for p in (stopped, waiting):
            p.kill()
            p.wait()
    assert 60 <= DEFAULT_STEP_TIMEOUT_S <= 600  # long enough for a first step's compilation, not 15 minutes


def test_frozen_worker_is_named_after_the_step_timeout(qwen3_ckpt, monkeypatch):
    monkeypatch.setenv("MOE_STEP_TIMEOUT_S", "2")
    llm = LLM(qwen3_ckpt, dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=64,
              num_gpu_blocks_override=32)
    pids = llm.llm_engine.executor.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 2
    os.kill(pids[1], signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerFailure, match=rf"worker rank 1 \(pid {pids[1]}\) did not answer: it is stopped") \
                as info:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
        assert time.monotonic() - start < 15
        assert "rank(s) [0] are waiting" in str(info.value) and "MOE_STEP_TIMEOUT_S" in str(info.value)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        llm.shutdown()


def test_script_without_main_guard_is_told_so(qwen3_ckpt, tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent(f"""
        from moe import LLM
        llm = LLM({qwen3_ckpt!r}, dtype="float32", device="cpu", tensor_parallel_size=2, max_model_len=64)
        print("built")
    """))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MOE_WORKER_START_TIMEOUT_S": "60"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=str(tmp_path))
    assert proc.returncode != 0 and "built" not in proc.stdout
    assert "exited at start" in proc.stderr and "no `if __name__ == \"__main__\":` guard" in proc.stderr
