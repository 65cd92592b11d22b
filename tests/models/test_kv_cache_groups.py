"""Each family's KV-cache accounting: MLA caches only the latent, Llama-4's chunked-local
layers hold only their current chunk (a KV-cache group of their own)."""
from __future__ import annotations

import random

import pytest

from moe import LLM, SamplingParams
from tests.factories_deepseek import DSV3_TINY, make_deepseek_v3_checkpoint
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
