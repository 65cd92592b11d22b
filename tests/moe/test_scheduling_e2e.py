"""Scheduler settings change how work is batched, never what is generated."""
from __future__ import annotations

import random

import pytest

from moe import LLM, SamplingParams

CONFIGS = {
    "budget16_seqs4": dict(max_num_batched_tokens=16, max_num_seqs=4),
    "tiny_cache_preempts": dict(num_gpu_blocks_override=8, block_size=16, max_model_len=128),
    "prefix_cache": dict(enable_prefix_caching=True),
    "all_together": dict(max_num_batched_tokens=16, max_num_seqs=4, num_gpu_blocks_override=8, block_size=16,
                         max_model_len=128, enable_prefix_caching=True),
}


def _prompts():
    rng = random.Random(3)
    shared = [rng.randrange(1, 500) for _ in range(34)]
    return [{"prompt_token_ids": shared[:rng.choice([16, 34])]
             + [rng.randrange(1, 500) for _ in range(rng.randint(1, 20))]} for _ in range(8)]


def _params():
    # Greedy rows and seeded random rows: both must survive preemption unchanged.
    return [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True) for i in range(8)]


@pytest.fixture(scope="module")
def reference(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, device="cpu", max_model_len=128, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), _params(), use_tqdm=False)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_tokens_as_default(qwen3_ckpt, reference, name):
    llm = LLM(qwen3_ckpt, device="cpu", **{"max_model_len": 128, **CONFIGS[name]})
    outs = llm.generate(_prompts(), _params(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    metrics = {m.name: m.value for m in llm.get_metrics()}
    preemptions = next(v for k, v in metrics.items() if "preemption" in k)
    hits = next(v for k, v in metrics.items() if "prefix_cache_hits" in k)
    if "tiny_cache" in name or name == "all_together":
        assert preemptions > 0
    if llm.llm_engine.args.enable_prefix_caching:
        assert hits > 0
    sched = llm.llm_engine.scheduler
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks  # nothing leaked


def test_cache_too_small_for_max_model_len_is_a_clear_error(qwen3_ckpt):
    with pytest.raises(ValueError, match="fewer than max_model_len=256"):
        LLM(qwen3_ckpt, device="cpu", max_model_len=256, num_gpu_blocks_override=8, block_size=16)


def test_chunked_prefill_off_needs_big_budget(qwen3_ckpt):
    with pytest.raises(ValueError, match="chunked prefill disabled"):
        LLM(qwen3_ckpt, device="cpu", max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)


def test_periodic_stats_line_counts_preemptions(qwen3_ckpt, caplog, monkeypatch):
    import moe.engine.llm_engine

    monkeypatch.setattr(moe.engine.llm_engine, "_STATS_INTERVAL_S", 0.0)
    llm = LLM(qwen3_ckpt, device="cpu", disable_log_stats=False, expert_load_window_steps=2,
              **CONFIGS["tiny_cache_preempts"])
    with caplog.at_level("INFO", logger="moe"):
        llm.generate(_prompts(), _params(), use_tqdm=False)
    stats = [r.getMessage() for r in caplog.records if "Avg generation throughput" in r.getMessage()]
    assert stats and "total_cumulative_preemption_cnt=" in stats[-1]
    assert "Expert load balancedness: 1.000, " in stats[-1]  # one rank: balanced by definition
    assert int(stats[-1].rsplit("=", 1)[1]) == llm.llm_engine.scheduler.num_preemptions > 0
