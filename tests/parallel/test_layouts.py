"""Each parallel layout, in spawned gloo workers on the CPU, gives the single process's greedy
tokens (and logprobs to 1e-4), expert load and returned routed experts on a tiny Qwen3-MoE
checkpoint."""
from __future__ import annotations

import multiprocessing

import pytest

from moe import LLM
from tests.parallel.conftest import assert_same_as_reference, prompts, routed_experts, sampling_params, summarize

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "tp2_ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True),
    "dp2_ep2_all_to_all": dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all"),
    # Capacity max_num_seqs=4: decode steps take the fixed-capacity path, prefills fall back.
    "dp2_ep2_low_latency": dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="low_latency",
                                max_num_seqs=4),
    # Small blocks and token budget: chunked prefill over several steps through both stages.
    "tp2_pp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=16),
    "dp2_tp2_ep4_round_robin": dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                                    all2all_backend="allgather_reducescatter",
                                    expert_placement_strategy="round_robin"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(parallel_ckpt, reference, reference_load, reference_routed, layout):
    kwargs = LAYOUTS[layout]
    llm = LLM(parallel_ckpt, dtype="float32", device="cpu", enable_return_routed_experts=True, **kwargs)
    try:
        engine = llm.llm_engine
        assert len(engine.executor.worker_pids) == (kwargs.get("tensor_parallel_size", 1)
                                                    * kwargs.get("pipeline_parallel_size", 1)
                                                    * kwargs.get("data_parallel_size", 1))
        raw = llm.generate(prompts(), sampling_params(), use_tqdm=False)
        assert_same_as_reference(summarize(raw), reference)
        # Every stage's MoE layers (pipeline), from TP rank 0 of each, per replica (data parallel).
        for got_routed, want in zip(routed_experts(raw), reference_routed, strict=True):
            assert want.shape[1] == 3 and got_routed.shape == want.shape
            assert (got_routed == want).all()
        # Each token counts once over the ranks: not per TP rank, not for the dummy batches.
        load = llm.get_expert_load()
        assert load.layers == reference_load.layers
        assert load.counts.tolist() == reference_load.counts.tolist()
        ep = engine.executor.layout.world_size // kwargs.get("pipeline_parallel_size", 1) \
            if kwargs.get("enable_expert_parallel") else 1
        assert load.per_rank.shape == (len(load.layers), ep)
        assert (load.per_rank.sum(axis=1) == load.counts.sum(axis=1)).all()
        if kwargs.get("data_parallel_size", 1) > 1:
            # Requests were dealt to both replicas, and both finished.
            assert [s.num_running + s.num_waiting for s in engine.schedulers] == [0, 0]
            assert all(s.kv.prefix_cache_queries > 0 for s in engine.schedulers)
            if kwargs.get("enable_expert_parallel"):  # the idle replica kept the MoE collectives going
                assert engine.executor.num_dummy_batches > 0
        # A second generate on the same workers: state carried across calls stays consistent.
        again = summarize(llm.generate(prompts()[:2], sampling_params()[:2], use_tqdm=False))
        assert_same_as_reference(again, reference[:2])
    finally:
        llm.llm_engine.shutdown()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moe-worker")]


def test_replicated_kv_heads_and_tied_embeddings_over_stages(tmp_path):
    """One KV head on two TP ranks (replicated), and a tied lm_head on a last stage that does
    not hold the embedding (it loads from the embedding tensor)."""
    from tests.factories import make_qwen3_moe_checkpoint
    from tests.parallel.conftest import CKPT_OVERRIDES

    path = make_qwen3_moe_checkpoint(str(tmp_path / "tied"), seed=9, num_key_value_heads=1,
                                     tie_word_embeddings=True, **CKPT_OVERRIDES)
    reference = summarize(LLM(path, dtype="float32", device="cpu").generate(prompts(), sampling_params(),
                                                                            use_tqdm=False))
    llm = LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2, pipeline_parallel_size=2)
    try:
        assert_same_as_reference(summarize(llm.generate(prompts(), sampling_params(), use_tqdm=False)), reference)
    finally:
        llm.llm_engine.shutdown()


def test_weight_update_and_sleep_on_every_rank(parallel_ckpt, reference, tmp_path):
    """TP=2 x EP=2 workers: update_weights to another checkpoint's tensors gives its single-process
    outputs (each rank slices its shard), and sleep / wake_up at level 2 plus an update gives them back."""
    from models.loader import checkpoint_files
    from safetensors.torch import load_file
    from tests.factories import make_qwen3_moe_checkpoint
    from tests.parallel.conftest import CKPT_OVERRIDES

    other = make_qwen3_moe_checkpoint(str(tmp_path / "other"), seed=6, **CKPT_OVERRIDES)
    other_ref = summarize(LLM(other, dtype="float32", device="cpu").generate(prompts(), sampling_params(),
                                                                             use_tqdm=False))

    def tensors(path):
        out = {}
        for f in checkpoint_files(path):
            out.update(load_file(f))
        return out

    llm = LLM(parallel_ckpt, dtype="float32", device="cpu", tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        llm.update_weights(tensors(other).items())
        assert_same_as_reference(summarize(llm.generate(prompts(), sampling_params(), use_tqdm=False)), other_ref)
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(tensors(parallel_ckpt).items())
        assert_same_as_reference(summarize(llm.generate(prompts(), sampling_params(), use_tqdm=False)), reference)
    finally:
        llm.llm_engine.shutdown()
