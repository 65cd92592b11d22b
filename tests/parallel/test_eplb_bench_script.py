"""benchmarks/eplb_gpu_bench.py on the CPU: two data-parallel replicas with expert parallelism
(gloo) on the tiny parallel checkpoint, tiny sizes; the JSON's numbers, a better balance after the
rebalance, the same greedy tokens; the skewed prompts and the deadline on their own."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from benchmarks.eplb_gpu_bench import main, skewed_prompts, zipf_token_ids

SIZES = ["--device", "cpu", "--num-requests", "8", "--prompt-len", "24", "--decode-steps", "6"]


def test_skewed_prompts_follow_the_zipf_weights():
    prompts = skewed_prompts(64, 200, vocab=512, distinct=16, exponent=1.2, seed=3)
    assert prompts == skewed_prompts(64, 200, vocab=512, distinct=16, exponent=1.2, seed=3)  # seeded
    assert prompts != skewed_prompts(64, 200, vocab=512, distinct=16, exponent=1.2, seed=4)
    ids, probs = zipf_token_ids(512, 16, 1.2, seed=3)
    assert len(set(ids.tolist())) == 16 and ids.min() >= 1 and ids.max() < 512
    assert np.all(np.diff(probs) < 0) and abs(probs.sum() - 1) < 1e-12
    tokens = Counter(t for p in prompts for t in p["prompt_token_ids"])
    assert set(tokens) <= set(ids.tolist()) and len(prompts[0]["prompt_token_ids"]) == 200
    total = sum(tokens.values())
    for token_id, p in zip(ids[:3].tolist(), probs[:3]):  # the heaviest ids at their weight (12800 draws)
        assert abs(tokens[token_id] / total - p) < 0.02, (token_id, tokens[token_id] / total, p)
    with pytest.raises(ValueError, match="distinct-tokens"):
        zipf_token_ids(512, 512, 1.2, seed=0)


def test_a_spent_deadline_skips_every_case_and_fails(parallel_ckpt, tmp_path):
    out = tmp_path / "eplb.json"
    assert main(["--checkpoint", parallel_ckpt, "--out", str(out), "--deadline-s", "0", *SIZES]) == 1
    res = json.loads(out.read_text())
    assert res["ok"] is False
    assert set(res["cases"]) == {"eplb_r0", "eplb_r32", "baseline"}
    assert all("skipped" in c for c in res["cases"].values())


def test_eplb_bench_balances_a_skewed_load_and_keeps_tokens(parallel_ckpt, tmp_path):
    out = tmp_path / "eplb.json"
    assert main(["--checkpoint", parallel_ckpt, "--out", str(out), "--redundant", "0", "2", *SIZES]) == 0
    res = json.loads(out.read_text())
    assert res["ok"] is True and set(res["cases"]) == {"eplb_r0", "eplb_r2", "baseline"}
    for name in ("eplb_r0", "eplb_r2"):
        case = res["cases"][name]
        assert "error" not in case, case
        assert case["tokens_identical"] is True and case["same_routing"] is True
        assert case["after_vs_before"] == {"identical": 8, "of": 8, "first_divergence": {}}
        assert case["before_vs_warmup"]["identical"] == 8
        assert case["rebalance_move_s"] > 0 and case["rebalance_call_s"] >= case["rebalance_move_s"]
        for run in (case["before"], case["after"]):
            assert run["decode_steps_timed"] >= 4 and run["median_step_ms"] > 0
            assert run["min_step_ms"] <= run["median_step_ms"] <= run["max_step_ms"]
            # 3 MoE layers, top-2: (24 prompt + 5 decoded tokens) x 8 requests x 2 per layer
            assert run["tokens_routed"] == 3 * 2 * 8 * (24 + 5)
            assert sum(run["balancedness"]["rows_per_rank"]) == run["tokens_routed"]
            assert len(run["balancedness"]["per_layer"]) == 3
            assert 0 < run["balancedness"]["min"] <= run["balancedness"]["mean"] <= 1
            assert 0 < run["balancedness_decode"]["mean"] <= 1
            assert run["expert_max_over_mean"] > 1.5  # the skew reaches the routers
        before, after = case["before"]["balancedness"]["mean"], case["after"]["balancedness"]["mean"]
        print(name, "balancedness before", before, "after", after, "predicted", case["predicted_after"])
        assert after >= before
        # as placed: exactly without replicas; with them the prediction splits each expert's tokens evenly
        assert abs(after - case["predicted_after"]) < (1e-9 if name == "eplb_r0" else 0.02)
    redundant = res["cases"]["eplb_r2"]
    assert redundant["before"]["balancedness"]["mean"] < 0.95  # clearly unbalanced before
    assert redundant["after"]["balancedness"]["mean"] > redundant["before"]["balancedness"]["mean"] + 0.03
    base = res["cases"]["baseline"]
    assert base["run"]["median_step_ms"] > 0 and base["eplb_before_vs_baseline"]["identical"] == 8
