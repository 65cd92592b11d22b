"""EPLB end to end on the CPU: two data-parallel replicas with expert parallelism (gloo), redundant
experts, rebalances at a step interval and on demand: the same tokens before, across and after a
rebalance, and a better balance on a skewed workload."""
from __future__ import annotations

import dataclasses

from moe import LLM, SamplingParams
from tests.parallel.conftest import assert_same_as_reference, prompts, sampling_params, summarize


def test_eplb_keeps_tokens_and_balances_a_skewed_load(parallel_ckpt, reference):
    llm = LLM(parallel_ckpt, dtype="float32", device="cpu", data_parallel_size=2, enable_expert_parallel=True,
              enable_eplb=True, expert_load_window_steps=1, enable_prefix_caching=False,
              eplb_config={"window_size": 8, "step_interval": 3, "num_redundant_experts": 2})
    try:
        core = llm.llm_engine.core
        # Rebalances every 3 steps while the reference workload runs: the same tokens and logprobs.
        got = summarize(llm.generate(prompts(), sampling_params(), use_tqdm=False))
        assert core.eplb.num_rebalances >= 1
        assert_same_as_reference(got, reference)

        # A skewed workload (one prompt eight times), then a rebalance on its load, then again.
        core.eplb.config = dataclasses.replace(core.eplb.config, step_interval=10**9)
        skewed = [prompts()[3]] * 8
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.reset_expert_load()
        before = [o.outputs[0].token_ids for o in llm.generate(skewed, params, use_tqdm=False)]
        load_before = llm.get_expert_load()
        placement_before = core.eplb.placement.phys_to_log_LP.clone()
        # the rebalance looks at exactly the skewed run's steps
        core.eplb.config = dataclasses.replace(core.eplb.config, window_size=load_before.num_steps)
        core.rebalance_experts()
        assert not (core.eplb.placement.phys_to_log_LP == placement_before).all()
        llm.reset_expert_load()
        after = [o.outputs[0].token_ids for o in llm.generate(skewed, params, use_tqdm=False)]
        load_after = llm.get_expert_load()
        assert after == before
        assert load_after.counts.tolist() == load_before.counts.tolist()  # routing itself is unchanged
        print("balancedness before", load_before.balancedness, "after", load_after.balancedness)
        assert load_after.balancedness.mean() > load_before.balancedness.mean() + 0.02
    finally:
        llm.llm_engine.shutdown()
