"""Checkpoint loading errors and config parsing."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.config import RopeConfig
from models.qwen3_moe import Qwen3MoeConfig
from models.registry import load_model_config, resolve_architecture
from moe import LLM


def _edit_checkpoint(path: str, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture
def ckpt_copy(tmp_path, qwen3_ckpt):
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(qwen3_ckpt, dst)
    return str(dst)


def test_missing_tensor_is_named(ckpt_copy):
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    _edit_checkpoint(ckpt_copy, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing tensor.*experts\.3\.up_proj\.weight"):
        LLM(ckpt_copy, device="cpu")


def test_wrong_shape_names_tensor_and_both_shapes(ckpt_copy):
    name = "model.layers.2.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(8, 64)
    _edit_checkpoint(ckpt_copy, edit)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\[8, 64\].*expects \[32, 64\]"):
        LLM(ckpt_copy, device="cpu")


def test_unexpected_tensor_is_named(ckpt_copy):
    _edit_checkpoint(ckpt_copy, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mystery\.weight'"):
        LLM(ckpt_copy, device="cpu")


def test_unknown_architecture_lists_supported(ckpt_copy):
    cfg_path = os.path.join(ckpt_copy, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["MysteryForCausalLM"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'MysteryForCausalLM'.*Qwen3MoeForCausalLM"):
        LLM(ckpt_copy, device="cpu")


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(OSError, match="does not exist"):
        LLM(str(tmp_path / "nope"), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="no config.json"):
        LLM(str(tmp_path / "empty"), device="cpu")


def test_missing_shard_named(tmp_path):
    from tests.factories import make_qwen3_moe_checkpoint

    path = make_qwen3_moe_checkpoint(str(tmp_path / "c"), shards=2, with_tokenizer=False)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(OSError, match="model-00002-of-00002.safetensors"):
        LLM(path, device="cpu")


def test_tp_that_does_not_divide_heads(qwen3_ckpt):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_attention_heads=4"):
        LLM(qwen3_ckpt, device="cpu", tensor_parallel_size=3)


def test_config_aliases():
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=4, num_experts_per_tok=1)
    a = Qwen3MoeConfig.from_hf({**base, "num_experts": 4, "rope_theta": 5.0}, "Qwen3MoeForCausalLM")
    b = Qwen3MoeConfig.from_hf({**base, "num_local_experts": 4, "head_dim": 16,
                                "rope_parameters": {"rope_theta": 5.0, "rope_type": "default"}}, "Qwen3MoeForCausalLM")
    assert a.num_experts == b.num_experts == 4
    assert a.rope.theta == b.rope.theta == 5.0
    assert a.head_dim == 4 and b.head_dim == 16
    assert RopeConfig.from_hf({"rope_theta": 2.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                    "beta_fast": 32}}).params == {"beta_fast": 32.0}
    with pytest.raises(ValueError, match="lacks the field 'num_experts_per_tok'"):
        Qwen3MoeConfig.from_hf({k: v for k, v in base.items() if k != "num_experts_per_tok"} | {"num_experts": 4},
                               "Qwen3MoeForCausalLM")


def test_sliding_window_is_refused_not_ignored():
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=10, hidden_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_experts=2, moe_intermediate_size=4, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        Qwen3MoeConfig.from_hf({**base, "hidden_act": "gelu"}, "Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        Qwen3MoeConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 64}, "Qwen3MoeForCausalLM")
    assert Qwen3MoeConfig.from_hf({**base, "use_sliding_window": False, "sliding_window": 64},
                                  "Qwen3MoeForCausalLM").num_experts == 2


def test_registry_errors():
    with pytest.raises(ValueError, match="no 'architectures'"):
        resolve_architecture({})


def test_dummy_weights_and_dtype(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, device="cpu", load_format="dummy", dtype="bfloat16", num_gpu_blocks_override=64,
              max_model_len=128)
    model = llm.llm_engine.executor.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    w = model.model.layers[0].mlp.experts.w13_weight
    assert w.abs().max() <= 1e-3 and w.abs().max() > 0
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16


def test_load_model_config_reads_typed_config(qwen3_ckpt):
    cls, cfg = load_model_config(qwen3_ckpt)
    assert cls.__name__ == "Qwen3MoeForCausalLM" and cfg.mlp_only_layers == [1] and not cfg.is_moe_layer(1)


def test_rope_table_sized_by_max_model_len_and_shared(qwen3_ckpt):
    llm = LLM(qwen3_ckpt, device="cpu", max_model_len=64)
    layers = llm.llm_engine.executor.model.model.layers
    tables = {id(layer.self_attn.rotary_emb) for layer in layers}
    assert len(tables) == 1  # one table for every layer
    assert layers[0].self_attn.rotary_emb.cos_cache.shape[0] == 64
