"""Each family's KV-cache accounting: MLA caches only the latent, Llama-4's chunked-local
layers hold only their current chunk (a KV-cache group of their own), and prefix caching reaches
through the local groups (Llama-4's chunks, gpt-oss's sliding windows) with the tokens unchanged."""
from __future__ import annotations

import random

import pytest

from moe import LLM, SamplingParams
from tests.factories_deepseek import DSV3_TINY, make_deepseek_v3_checkpoint
from tests.factories_gpt_oss import make_gpt_oss_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint


@pytest.fixture(scope="module")
def llama4_ckpt(tmp_path_factory):
    return save_llama4_checkpoint(make_llama4_model(seed=3), str(tmp_path_factory.mktemp("l4") / "ckpt"))


def test_mla_block_holds_only_the_latent(tmp_path):
    path = make_deepseek_v3_checkpoint(str(tmp_path / "dsv3"), seed=4, with_tokenizer=False)
    per_token = DSV3_TINY["kv_lora_rank"] + DSV3_TINY["qk_rope_head_dim"]
    block_bytes = DSV3_TINY["num_hidden_layers"] * 16 * per_token * 4  # fp32, block_size 16
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=100 * block_bytes)
    assert llm.llm_engine.executor.runner.kv_cache_bytes_per_block() == block_bytes
    assert llm.llm_engine.scheduler.kv.num_blocks == 100
    assert len(llm.llm_engine.scheduler.kv.groups) == 1


def test_llama4_chunked_group_is_small_and_released(llama4_ckpt):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 500) for _ in range(n)]} for n in (3, 19, 30, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # 5+ chunks of 8 per request
    ref = [o.outputs[0].token_ids for o in
           LLM(llama4_ckpt, device="cpu", max_model_len=128).generate(prompts, params, use_tqdm=False)]

    llm = LLM(llama4_ckpt, device="cpu", max_model_len=128, block_size=4, num_gpu_blocks_override=32,
              max_num_seqs=4, max_num_batched_tokens=16)
    kv = llm.llm_engine.scheduler.kv
    (full, chunked) = kv.groups
    assert full.chunk_size is None and chunked.chunk_size == 8
    # Per request: its chunk (2 blocks) + 1, plus one step's new tokens (4 blocks) + 1.
    assert chunked.num_blocks == 4 * 3 + 4 + 1 < full.num_blocks
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs, max_live = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.outputs[0].token_ids
        for blocks in kv.local[0].req_to_blocks.values():
            max_live = max(max_live, sum(b is not None for b in blocks))
    assert [outs[str(i)] for i in range(len(prompts))] == ref
    assert max_live <= 2 + 1 + 4  # never more than a chunk, the block being filled, one step's span
    for group in [kv] + kv.local:
        assert group.pool.num_free_blocks == group.pool.num_blocks


@pytest.mark.parametrize("family", ["llama4", "gpt_oss"])
def test_prefix_hits_through_local_groups_keep_the_tokens(family, llama4_ckpt, tmp_path):
    """A 41-token prompt, then prompts sharing 37, 41 and 18 of its tokens: with prefix caching they hit
    9, 10 and 4 blocks of 4 (each local group still holds the window before the hit: chunks of 8 for
    Llama-4, a window of 8 for gpt-oss) and give the tokens and logprobs of a run without it."""
    path = llama4_ckpt if family == "llama4" else make_gpt_oss_checkpoint(str(tmp_path / "gpt_oss"), seed=7)
    rng = random.Random(1)
    base = [rng.randrange(2, 500) for _ in range(41)]
    later = [base[:37] + [7, 8, 9], base, base[:18] + [5] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = {}
    for caching in (True, False):
        llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, block_size=4,
                  enable_prefix_caching=caching)
        outs = [o.outputs[0] for prompts in ([base], later)
                for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        runs[caching] = [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]
        kv = llm.llm_engine.scheduler.kv
        assert len(kv.groups) == 2 and kv.local[0].group.is_local
        if caching:
            assert kv.prefix_cache_hits == 4 * (9 + 10 + 4)
            assert kv.local[0].pool.enable_caching
        llm.shutdown()
    for (tokens, lps), (ref_tokens, ref_lps) in zip(runs[True], runs[False]):
        assert tokens == ref_tokens and max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4
