"""Qwen3-Next and Qwen3.5-MoE (hybrid: Gated DeltaNet linear attention beside gated full attention)
token for token with Hugging Face transformers through the whole engine: both checkpoint layouts,
prompts across the delta rule's 64-token chunks, prefill chunks of a few tokens (the recurrent
state carried across steps), preemption under a tiny cache (the state rebuilt from position 0),
aborts, TP=2, TP=2 x EP=2, PP=2 and DP=2 x EP=2 with EPLB on gloo; state slots never leak."""
from __future__ import annotations

import multiprocessing
import os
import random

import pytest

from moe import LLM, SamplingParams
from tests.factories import assert_outputs_match_hf, generate_greedy, load_hf_model
from tests.factories_qwen3_next import make_qwen3_next_checkpoint

# Spawned gloo workers inherit these: a bug fails instead of hanging (as tests/parallel/conftest.py).
os.environ.setdefault("MOE_COLLECTIVE_TIMEOUT_S", "60")
os.environ.setdefault("MOE_STEP_TIMEOUT_S", "90")
os.environ.setdefault("MOE_WORKER_START_TIMEOUT_S", "120")

PROMPT_LENGTHS = [1, 5, 17, 64, 70]  # one token; across the 16-token blocks and the 64-token chunk
EPLB = {"window_size": 8, "step_interval": 3, "num_redundant_experts": 2}


def state_slots(llm: LLM):
    """The scheduler's recurrent group (its state slots)."""
    groups = [g for g in llm.llm_engine.core.scheduler.kv.local if hasattr(g, "req_to_slot")]
    assert len(groups) == 1, "one recurrent KV-cache group"
    return groups[0]


def assert_no_slot_held(llm: LLM) -> None:
    slots = state_slots(llm)
    assert not slots.req_to_slot and slots.pool.num_free_blocks == slots.pool.num_blocks


def assert_matches_hf(model_dir: str, max_tokens: int = 8, prompt_lengths=PROMPT_LENGTHS, **llm_kwargs) -> LLM:
    llm, prompts, outs = generate_greedy(model_dir, prompt_lengths, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(load_hf_model(model_dir), prompts, outs, max_tokens)
    return llm


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def ckpt(request, tmp_path_factory):
    return make_qwen3_next_checkpoint(str(tmp_path_factory.mktemp(request.param)), arch=request.param, seed=3)


def test_matches_hf(ckpt):
    """Two sequences at a time: later prompts take slots that earlier ones left full of their state."""
    llm = assert_matches_hf(ckpt, max_num_seqs=2)
    assert not llm.llm_engine.core.scheduler.kv.enable_caching  # off: no state at a cached prefix's end
    assert_no_slot_held(llm)


def test_prefill_chunks_of_a_few_tokens_match_hf(ckpt):
    """Budgets of 5 tokens over 4-token blocks: every prompt's state is carried over many steps,
    decode rows beside prefill chunks."""
    llm = assert_matches_hf(ckpt, block_size=4, max_num_batched_tokens=5, max_num_seqs=3)
    assert_no_slot_held(llm)


@pytest.mark.parametrize("arch,layout", [("qwen3_next", "fused"), ("qwen3_5_moe", "fused")])
def test_fused_expert_layout_matches_hf(tmp_path, arch, layout):
    path = make_qwen3_next_checkpoint(str(tmp_path / "ckpt"), arch=arch, layout=layout, seed=4)
    assert_matches_hf(path, prompt_lengths=[3, 30])


def test_variants_match_hf(tmp_path):
    """A dense layer (mlp_only_layers), full attention every other layer, tied embeddings, MHA in
    the linear layers, two shards."""
    path = make_qwen3_next_checkpoint(str(tmp_path / "ckpt"), shards=2, seed=6, mlp_only_layers=[1],
                                      full_attention_interval=2, tie_word_embeddings=True, linear_num_key_heads=4)
    assert_matches_hf(path, prompt_lengths=[2, 40])


def _greedy(llm: LLM, prompts, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_preemption_rebuilds_the_state(ckpt):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(n)]} for n in (3, 20, 45, 9)]
    with LLM(ckpt, dtype="float32", device="cpu") as llm:
        roomy = _greedy(llm, prompts)
    # 16 blocks of 4 tokens for 4 sequences of up to 57 tokens: requests are preempted and recomputed,
    # two state slots taken in turn.
    with LLM(ckpt, dtype="float32", device="cpu", block_size=4, num_gpu_blocks_override=16,
             max_num_batched_tokens=32, max_model_len=64, max_num_seqs=2) as llm:
        tight = _greedy(llm, prompts)
        assert llm.llm_engine.core.scheduler.num_preemptions > 0, "the cache is small enough to preempt"
        assert_no_slot_held(llm)
    assert tight == roomy


def test_an_aborted_request_frees_its_slot_and_leaves_the_others_exact(ckpt):
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (12, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(ckpt, dtype="float32", device="cpu", max_num_batched_tokens=16) as llm:
        alone = _greedy(llm, [{"prompt_token_ids": prompts[1]}], 10)
        engine = llm.llm_engine
        engine.add_request("gone", {"prompt_token_ids": prompts[0]}, params)
        engine.add_request("kept", {"prompt_token_ids": prompts[1]}, params)
        engine.step()  # the first holds a slot now, mid-prefill
        assert "gone" in state_slots(llm).req_to_slot
        engine.abort_request(["gone"])
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        assert_no_slot_held(llm)
    assert list(done) == ["kept"] and done["kept"] == alone[0]


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(pipeline_parallel_size=2),
                                    dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                                         expert_load_window_steps=1, eplb_config=EPLB)],
                         ids=["tp2", "tp2_ep2", "pp2", "dp2_ep2_eplb"])
def test_parallel_layouts_match_hf(ckpt, layout):
    """Attention heads, key / value heads of the linear layers, their conv channels and states split
    over 2 ranks (spawned gloo workers); the routed experts TP-sliced, or 4 whole experts a rank;
    the layers (linear and full attention) in two pipeline stages, each holding its layers' state
    slots; two data-parallel replicas with their own schedulers and state slots, the experts and 2
    redundant replicas spread over both by EPLB, rebalanced every 3 steps."""
    llm, prompts, outs = generate_greedy(ckpt, [5, 33], 6, **layout)
    try:
        assert len(llm.llm_engine.executor.worker_pids) == 2
        if layout.get("enable_eplb"):
            assert llm.llm_engine.core.eplb.num_rebalances >= 1
        assert_outputs_match_hf(load_hf_model(ckpt), prompts, outs, 6)
    finally:
        llm.llm_engine.shutdown()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("moe-worker")]
