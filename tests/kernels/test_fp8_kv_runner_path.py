"""The runner's GPU path (step buffers, Triton KV writes and attention, the RoPE launch's KV write,
MLA's kernels) over an FP8 KV cache, forced on the CPU under TRITON_INTERPRET=1: greedy tokens equal
the torch reference path's over the same kind of cache, for each model family. The kernels' writes
are bit-identical to the reference's quantisation (tests/kernels/test_fp8_kv_cache.py), so the two
paths see the same cache. On a GPU: the engine there (eager and with CUDA graphs) against the CPU."""
from __future__ import annotations

import os
import random

import pytest
import torch

import models.layers.attention as attention_layer
import models.layers.mla_attention as mla_layer
import moe.worker.model_runner as model_runner
from moe import LLM, SamplingParams
from tests.factories_deepseek import make_deepseek_v3_checkpoint
from tests.factories_llama4 import make_llama4_model, save_llama4_checkpoint

forced_on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                   reason="forces the GPU path on the CPU through the Triton interpreter")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FAMILIES = {
    "qwen3_moe": lambda p: "tiny-qwen3-moe",
    "deepseek_v3": lambda p: make_deepseek_v3_checkpoint(p),
    "llama4": lambda p: save_llama4_checkpoint(make_llama4_model(), p) or p,
}


def _generate(path: str, prompts: list[dict], kv_cache_dtype: str, device: str = "cpu",
              **kw) -> tuple[list[list[int]], bool]:
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    if device == "cuda":  # a small cache: tests run side by side on one GPU (pytest-xdist)
        kw.update(gpu_memory_utilization=0.1, kv_cache_memory_bytes=64 << 20)
    with LLM(path, device=device, dtype="float32", max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
             block_size=4, kv_cache_dtype=kv_cache_dtype, **kw) as llm:
        runner = llm.llm_engine.executor.runner
        assert runner.kv_caches[0].dtype == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, runner.buffers is not None


def _prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(1, 500) for _ in range(9)]
    return [{"prompt_token_ids": p} for p in
            ([rng.randrange(1, 500)], [rng.randrange(1, 500) for _ in range(13)], shared + [7, 8], shared + [9])]


# e5m2 on the two attention kernel sets (GQA with chunked-local layers, MLA), not on Qwen3 too: the
# kernels' writes of both formats are checked bit for bit in test_fp8_kv_cache.py, and each family
# costs the interpreter 10-30 s.
@forced_on_cpu
@pytest.mark.parametrize("family,kv_cache_dtype", [(f, "fp8") for f in sorted(FAMILIES)]
                         + [("deepseek_v3", "fp8_e5m2"), ("llama4", "fp8_e5m2")])
def test_gpu_path_over_fp8_cache_matches_reference(family, kv_cache_dtype, tmp_path, monkeypatch):
    import models.layers.rotary as rotary_layer

    path = FAMILIES[family](str(tmp_path / family))
    prompts = _prompts()
    reference, buffered = _generate(path, prompts, kv_cache_dtype)
    assert not buffered

    always = lambda x: True  # noqa: E731
    monkeypatch.setattr(attention_layer, "use_triton_attention", always)
    monkeypatch.setattr(model_runner, "use_triton_attention", always)
    monkeypatch.setattr(mla_layer, "use_triton_path", always)
    monkeypatch.setattr(rotary_layer, "use_triton_fused", always)  # Qwen3: the RoPE launch writes K/V
    monkeypatch.setattr(attention_layer, "ROPE_WRITES_KV", True)
    forced, buffered = _generate(path, prompts, kv_cache_dtype)
    assert buffered
    assert forced == reference


@needs_cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_engine_over_fp8_cache_matches_the_cpu(family, kv_cache_dtype, eager, tmp_path):
    """On a GPU (eager, and with decode and mixed-step CUDA graphs) the engine's greedy tokens over an
    FP8 cache equal the CPU's over the same kind of cache (fp32 model: the caches hold the same bytes)."""
    path = FAMILIES[family](str(tmp_path / family))
    prompts = _prompts()
    cpu, _ = _generate(path, prompts, kv_cache_dtype)
    gpu, buffered = _generate(path, prompts, kv_cache_dtype, device="cuda", enforce_eager=eager)
    assert buffered and gpu == cpu
