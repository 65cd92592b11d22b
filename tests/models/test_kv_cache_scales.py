"""Per-tensor KV-cache scales in FP8 checkpoints, under the names quantisation tools write
(self_attn.k_scale / v_scale, {k,v}_proj.output_scale, {k,v}_proj.{k,v}_scale, the older kv_scale):
loaded into the attention layers' k_scale / v_scale, read past when they scale something not done
here (q_scale, prob_scale), never an "unexpected tensor" error; an FP8 cache quantises with them,
other caches ignore them (as vLLM)."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.loader import kv_scale_target
from moe import LLM, SamplingParams
from tests.factories import make_qwen3_moe_checkpoint
from tests.factories_deepseek import make_deepseek_v3_checkpoint


@pytest.mark.parametrize("name,target", [
    ("model.layers.3.self_attn.k_scale", (3, ("k_scale",))),
    ("model.layers.3.self_attn.v_scale", (3, ("v_scale",))),
    ("model.layers.0.self_attn.attn.k_scale", (0, ("k_scale",))),
    ("model.layers.1.self_attn.k_proj.output_scale", (1, ("k_scale",))),
    ("model.layers.1.self_attn.v_proj.output_scale", (1, ("v_scale",))),
    ("model.layers.1.self_attn.q_proj.output_scale", (1, ())),
    ("model.layers.2.self_attn.k_proj.k_scale", (2, ("k_scale",))),
    ("model.layers.2.self_attn.kv_scale", (2, ("k_scale", "v_scale"))),
    ("language_model.model.layers.5.self_attn.v_proj.v_scale", (5, ("v_scale",))),
    ("model.layers.2.self_attn.q_scale", (2, ())),
    ("model.layers.2.self_attn.prob_scale", (2, ())),
    ("model.layers.2.self_attn.k_proj.weight", None),
    ("model.layers.2.self_attn.k_proj.weight_scale", None),
    ("model.layers.2.self_attn.output_scale", None),
    ("model.layers.2.mlp.experts.0.gate_proj.weight_scale_inv", None),
])
def test_scale_names(name, target):
    assert kv_scale_target(name) == target


def _add_tensors(path: str, extra: dict[str, torch.Tensor]) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def _scales(llm) -> list[tuple[float, float]]:
    return [(a.k_scale, a.v_scale) for a in llm.llm_engine.executor.runner.model.attention_layers()]


QWEN3_SCALES = {  # three layers, three naming schemes, plus scales of FP8 attention maths to read past
    "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
    "model.layers.0.self_attn.q_scale": torch.tensor(2.0),
    "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125]),
    "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([4.0]),
    "model.layers.1.self_attn.q_proj.output_scale": torch.tensor([3.0]),
    "model.layers.2.self_attn.kv_scale": torch.tensor(0.75, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto"])
def test_qwen3_checkpoint_scales_load(tmp_path, kv_cache_dtype):
    path = _add_tensors(make_qwen3_moe_checkpoint(str(tmp_path / "q")), QWEN3_SCALES)
    with LLM(path, device="cpu", max_model_len=64, kv_cache_memory_bytes=4 << 20, kv_cache_dtype=kv_cache_dtype) as llm:
        assert _scales(llm) == [(0.5, 0.25), (0.125, 4.0), (0.75, 0.75)]
        out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_scales_change_what_an_fp8_cache_stores(tmp_path):
    """A tiny k_scale saturates the stored keys (|k| / scale beyond 448): the tokens then differ
    from the unit-scale run's, while a float cache ignores the same scales."""
    plain = make_qwen3_moe_checkpoint(str(tmp_path / "plain"))
    scaled = _add_tensors(make_qwen3_moe_checkpoint(str(tmp_path / "scaled")), {
        f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(1e-4) for i in range(3) for kv in "kv"})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(4)]
    runs = {}
    for name, path in (("plain", plain), ("scaled", scaled)):
        for kv in ("auto", "fp8"):
            with LLM(path, device="cpu", max_model_len=64, kv_cache_memory_bytes=4 << 20, kv_cache_dtype=kv) as llm:
                runs[name, kv] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs["plain", "auto"] == runs["scaled", "auto"]
    assert runs["plain", "fp8"] != runs["scaled", "fp8"]


def test_deepseek_mla_takes_k_scale(tmp_path):
    path = _add_tensors(make_deepseek_v3_checkpoint(str(tmp_path / "ds")), {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(0.125),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.375)})
    with LLM(path, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20,
             kv_cache_dtype="fp8") as llm:
        scales = _scales(llm)
        assert scales[0] == (0.5, 0.125) and scales[1] == (0.375, 0.375)
        out = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("value,match", [(torch.tensor([0.5, 0.5]), "only one floating-point KV-cache scale"),
                                         (torch.tensor(0.0), "must be positive")])
def test_bad_scales_are_named(tmp_path, value, match):
    path = _add_tensors(make_qwen3_moe_checkpoint(str(tmp_path / "q")), {"model.layers.1.self_attn.k_scale": value})
    with pytest.raises(ValueError, match=match) as info:
        LLM(path, device="cpu", max_model_len=64, kv_cache_memory_bytes=4 << 20, kv_cache_dtype="fp8")
    assert "model.layers.1.self_attn.k_scale" in str(info.value)
