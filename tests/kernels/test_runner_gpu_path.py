"""The runner's GPU input path (step buffers, device metadata, Triton attention for GQA,
chunked-local and MLA layers) forced on the CPU under TRITON_INTERPRET=1: greedy tokens equal
the torch reference path's for each model family, through chunked prefill, prefix-cache hits
and mixed prefill + decode batches. (CUDA graphs need a GPU: benchmarks/gpu_engine_bench.py.)"""
from __future__ import annotations

import os
import random

import pytest
import torch

import models.layers.attention as attention_layer
import models.layers.mla_attention as mla_layer
import moe.worker.model_runner as model_runner
from moe import LLM, SamplingParams
from tests.factories import make_qwen3_moe_checkpoint
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                reason="forces the GPU path on the CPU through the Triton interpreter")

FAMILIES = {
    "qwen3_moe": lambda p: make_qwen3_moe_checkpoint(p),
    "deepseek_v3": lambda p: make_deepseek_v3_checkpoint(p),
    "llama4": lambda p: save_llama4_checkpoint(make_llama4_model(), p),  # chunk of 8: boundaries inside prompts
}


def _generate(path: str, prompts: list[dict]) -> tuple[list[list[int]], bool]:
    """Greedy tokens, and whether the steps went through the step buffers (the GPU input path)."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(path, device="cpu", dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
             block_size=4) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, llm.llm_engine.executor.runner.buffers is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpu_input_path_matches_reference(family, tmp_path, monkeypatch):
    path = FAMILIES[family](str(tmp_path / family))
    rng = random.Random(0)
    shared = [rng.randrange(1, 500) for _ in range(9)]
    prompts = [{"prompt_token_ids": p} for p in
               ([rng.randrange(1, 500)], [rng.randrange(1, 500) for _ in range(13)], shared + [7, 8], shared + [9])]
    reference, buffered = _generate(path, prompts)
    assert not buffered and len(reference) == len(prompts)

    always = lambda x: True  # noqa: E731
    monkeypatch.setattr(attention_layer, "use_triton_attention", always)
    monkeypatch.setattr(model_runner, "use_triton_attention", always)
    monkeypatch.setattr(mla_layer, "use_triton_path", always)
    forced, buffered = _generate(path, prompts)
    assert buffered  # the step buffers served the steps
    assert forced == reference


def test_qwen3_rope_launch_writes_the_kv_cache(tmp_path, monkeypatch):
    """With the fused q/k norm + RoPE kernel on too, Qwen3's RoPE launch writes each layer's K/V
    (the attention's own KV write never runs) and the tokens stay the reference's."""
    import models.layers.rotary as rotary_layer

    path = FAMILIES["qwen3_moe"](str(tmp_path / "qwen3"))
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(n)]} for n in (1, 6, 13)]
    reference, _ = _generate(path, prompts)

    always = lambda x: True  # noqa: E731
    monkeypatch.setattr(attention_layer, "use_triton_attention", always)
    monkeypatch.setattr(model_runner, "use_triton_attention", always)
    monkeypatch.setattr(rotary_layer, "use_triton_fused", always)
    monkeypatch.setattr(attention_layer, "ROPE_WRITES_KV", True)  # whatever MOE_ROPE_KV_WRITE says
    separate_writes = []
    write = attention_layer.write_kv_cache_triton
    monkeypatch.setattr(attention_layer, "write_kv_cache_triton",
                        lambda *a: (separate_writes.append(1), write(*a)))
    forced, buffered = _generate(path, prompts)
    assert buffered and forced == reference
    assert not separate_writes, f"{len(separate_writes)} separate KV writes"
