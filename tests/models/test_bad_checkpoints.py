"""Damaged checkpoints fail at load with an error that names the file and the field or tensor,
instead of loading and then misbehaving."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.deepseek_v3 import DeepseekV3Config
from moe import LLM
from tests.factories_deepseek import DSV3_TINY


@pytest.fixture
def ckpt(tmp_path, qwen3_ckpt):
    dst = tmp_path / "copy"
    shutil.copytree(qwen3_ckpt, dst)
    return str(dst)


def edit_config(path: str, **changes) -> str:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)
    return file


def edit_tensors(path: str, edit) -> str:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    return file


def load(path: str, **kw):
    return LLM(path, device="cpu", dtype="float32", max_model_len=32, **kw)


@pytest.mark.parametrize("changes,match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and num_experts=8"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be between 1 and num_experts=8"),
    ({"hidden_size": "abc"}, "field hidden_size='abc' must be an integer"),
    ({"hidden_size": 64.5}, "field hidden_size=64.5 must be an integer"),
    ({"num_hidden_layers": 0}, "field num_hidden_layers=0 must be positive"),
    ({"moe_intermediate_size": -32}, "field moe_intermediate_size=-32 must be positive"),
    ({"torch_dtype": "int8"}, "field torch_dtype='int8' is not supported"),
])
def test_bad_config_fields_name_file_and_field(ckpt, changes, match):
    file = edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=match) as info:
        load(ckpt)
    assert file in str(info.value)


@pytest.mark.parametrize("changes,match", [
    ({"n_group": 3}, "n_group=3 does not divide n_routed_experts=16"),
    ({"topk_group": 5}, "topk_group=5 must be between 1 and n_group=4"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds the 8 experts of the topk_group=2 groups"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok=17 must be between 1 and n_routed_experts=16"),
])
def test_deepseek_grouped_routing_fields_checked(changes, match):
    with pytest.raises(ValueError, match=match):
        DeepseekV3Config.from_hf({**DSV3_TINY, **changes}, "DeepseekV3ForCausalLM")
    DeepseekV3Config.from_hf(DSV3_TINY, "DeepseekV3ForCausalLM")  # the unchanged config passes


def test_expert_beyond_num_experts_raises(ckpt):
    def add_expert(t):
        t["model.layers.0.mlp.experts.8.gate_proj.weight"] = t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()
    edit_tensors(ckpt, add_expert)
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj.*expert 8 is beyond the model's 8 experts"):
        load(ckpt)


def test_integer_weight_tensor_raises_naming_it(ckpt):
    name = "model.layers.0.self_attn.q_proj.weight"

    def to_int(t):
        t[name] = (t[name] * 100).to(torch.int8)
    edit_tensors(ckpt, to_int)
    with pytest.raises(ValueError, match=rf"tensor '{name}'.*dtype torch.int8.*floating-point"):
        load(ckpt)


def test_truncated_safetensors_names_the_file(ckpt):
    file = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        load(ckpt)
    assert file in str(info.value)


def test_truncated_tokenizer_names_the_file(ckpt):
    file = os.path.join(ckpt, "tokenizer.json")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match="cannot load the tokenizer") as info:
        load(ckpt)
    assert file in str(info.value)


def test_small_kv_cache_on_cpu_names_the_cpu_setting(ckpt):
    with pytest.raises(ValueError, match="on the CPU the KV cache is sized by kv_cache_memory_bytes") as info:
        load(ckpt, kv_cache_memory_bytes=4096)
    assert "gpu_memory_utilization" not in str(info.value)
    with pytest.raises(ValueError, match="raise num_gpu_blocks_override"):
        load(ckpt, num_gpu_blocks_override=1)
