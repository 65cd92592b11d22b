"""One LLM, several threads calling generate at once (with a very fast thread switch interval):
each caller gets exactly its own outputs, equal to a single-threaded run, in bounded time."""
from __future__ import annotations

import sys
import threading

import pytest

from moe import LLM, SamplingParams

NUM_THREADS, ROUNDS = 4, 3


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3-moe", device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=64)


def work(thread: int, round_: int):
    """Prompts of different lengths and sampling parameters per thread and round."""
    prompts = [{"prompt_token_ids": [(thread * 37 + round_ * 11 + i * 5) % 500 + 1 for i in range(3 + thread + j)]}
               for j in range(2)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + thread, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=thread * 10 + round_, max_tokens=4, ignore_eos=True)]
    return prompts, params


def tokens(outs):
    return [(o.prompt_token_ids, [c.token_ids for c in o.outputs]) for o in outs]


def test_concurrent_generate_gives_each_caller_its_own_outputs(llm):
    expected = {(t, r): tokens(llm.generate(*work(t, r), use_tqdm=False))
                for t in range(NUM_THREADS) for r in range(ROUNDS)}
    got, errors = {}, []

    def caller(t):
        try:
            for r in range(ROUNDS):
                got[(t, r)] = tokens(llm.generate(*work(t, r), use_tqdm=False))
        except BaseException as e:  # reported below, with the thread
            errors.append((t, repr(e)))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=caller, args=(t,), daemon=True) for t in range(NUM_THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        stuck = [i for i, th in enumerate(threads) if th.is_alive()]
    finally:
        sys.setswitchinterval(old)
    assert not stuck, f"thread(s) {stuck} still running after 60 s: generate hangs under concurrency"
    assert not errors, errors
    assert got == expected
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.usage() == 0.0
    assert not llm._done
