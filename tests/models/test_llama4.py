"""Llama-4 text token for token with Hugging Face transformers, through the whole engine.

Prompts of 1-40 tokens plus 12 generated ones cross several 8-token attention chunks; with
floor_scale 4 the NoPE layers' temperature grows within them. Small blocks and a 16-token budget
make decode and chunked prefill read cached context across chunk boundaries.
"""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from models.llama4 import Llama4TextConfig
from models.registry import load_model_config
from moe import LLM
from tests.factories import assert_outputs_match_hf, generate_greedy
from tests.factories_llama4 import LLAMA3_ROPE, LLAMA4_TINY, make_llama4_model, save_llama4_checkpoint

PROMPT_LENGTHS = [1, 8, 13, 20, 33, 40]
SMALL = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def assert_matches_hf(hf_model, model_dir: str, max_tokens: int = 12, **llm_kwargs) -> None:
    _, prompts, outs = generate_greedy(model_dir, PROMPT_LENGTHS, max_tokens, **llm_kwargs)
    assert_outputs_match_hf(hf_model, prompts, outs, max_tokens)


@pytest.fixture(scope="module")
def base_model():
    return make_llama4_model(seed=0)


def test_text_checkpoint_matches_hf(tmp_path, base_model):
    assert_matches_hf(base_model, save_llama4_checkpoint(base_model, str(tmp_path / "ckpt")))


def test_multimodal_checkpoint_small_blocks_match_hf(tmp_path, base_model, caplog):
    """Nested `language_model.` names + text_config, vision tower skipped with one log line;
    blocks of 3 put chunk boundaries inside blocks."""
    path = save_llama4_checkpoint(base_model, str(tmp_path / "mm"), layout="multimodal", shards=2)
    with caplog.at_level(logging.INFO, logger="moe.models.llama4"):
        assert_matches_hf(base_model, path, **{**SMALL, "block_size": 3})
    skips = [r for r in caplog.records if "vision" in r.getMessage()]
    assert len(skips) == 1, [r.getMessage() for r in skips]


def test_llama3_rope_top2_tied_bias_variant_matches_hf(tmp_path):
    """llama3 RoPE scaling, top-2 routing (each expert gets its own scaled input), MoE layers
    from interleave_moe_layer_step, no q/k norm, tied embeddings, attention bias."""
    hf = make_llama4_model(seed=5, rope_parameters=LLAMA3_ROPE, num_experts_per_tok=2, moe_layers=None,
                           interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1, 1], use_qk_norm=False,
                           tie_word_embeddings=True, attention_bias=True)
    assert hf.config.moe_layers == [1, 3]
    assert_matches_hf(hf, save_llama4_checkpoint(hf, str(tmp_path / "ckpt")), **SMALL)


def test_hub_config_quirks_match_hf(tmp_path):
    """`"attn_temperature_tuning": 4` and `"no_rope_layers": []` (every 2nd layer NoPE via
    no_rope_layer_interval), as some hub configs have them; transformers 5 itself refuses the int."""
    hf = make_llama4_model(seed=2, no_rope_layers=None, no_rope_layer_interval=2)
    assert hf.config.no_rope_layers == [1, 0, 1, 0]
    path = save_llama4_checkpoint(hf, str(tmp_path / "ckpt"), layout="multimodal", config_edits=dict(
        attn_temperature_tuning=4, no_rope_layers=[], layer_types=None))
    assert_matches_hf(hf, path, **SMALL)


# ---- config parsing (no model) ---------------------------------------------------------------

def _hf_text_dict(**overrides) -> dict:
    from transformers import Llama4TextConfig as HFConfig

    d = HFConfig(**{**LLAMA4_TINY, **overrides}).to_dict()
    d["architectures"] = ["Llama4ForCausalLM"]
    return d


def test_nested_config_unwraps_text_config(tmp_path):
    text = {k: v for k, v in _hf_text_dict().items() if k not in ("architectures", "dtype", "rope_parameters")}
    # The hub's legacy spelling: rope_theta + rope_scaling.
    text.update(rope_theta=500000.0, rope_scaling={k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    raw = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "dtype": "bfloat16",
           "text_config": text,
           "vision_config": {"hidden_size": 32}}
    os.makedirs(tmp_path / "c")
    with open(tmp_path / "c" / "config.json", "w") as f:
        json.dump(raw, f)
    cls, cfg = load_model_config(str(tmp_path / "c"))
    assert cls.__name__ == "Llama4ForCausalLM" and isinstance(cfg, Llama4TextConfig)
    assert cfg.nested_checkpoint and cfg.architecture == "Llama4ForConditionalGeneration"
    assert (cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size_mlp) == (64, 4, 96)
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.rope.scaling_type == "llama3" and cfg.rope.theta == 500000.0
    assert cfg.rope.original_max_position_embeddings == 16
    assert cfg.layer_types == ["chunked_attention", "chunked_attention", "full_attention", "full_attention"]


def test_config_defaults_follow_transformers():
    raw = _hf_text_dict()
    for key in ("no_rope_layers", "layer_types", "moe_layers", "rope_parameters"):
        raw.pop(key)
    raw.update(no_rope_layers=[], interleave_moe_layer_step=2, attn_temperature_tuning=4)
    cfg = Llama4TextConfig.from_hf(raw, "Llama4ForCausalLM")
    assert cfg.no_rope_layers == [1, 1, 1, 0]  # no_rope_layer_interval defaults to 4
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert cfg.moe_layers == [1, 3]
    assert cfg.attn_temperature_tuning is True
    assert cfg.rope.theta == 500000.0  # Llama4TextConfig.default_theta
    raw["attention_chunk_size"] = None
    assert Llama4TextConfig.from_hf(raw, "Llama4ForCausalLM").layer_types == ["full_attention"] * 4


def test_expert_tensor_in_our_layout_is_rejected(tmp_path, base_model):
    """Hub down_proj is [E, F, D]; one in our [E, D, F] layout is named with both shapes."""
    from safetensors.torch import load_file, save_file

    path = save_llama4_checkpoint(base_model, str(tmp_path / "ckpt"))
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.1.feed_forward.experts.down_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.down_proj.*\[4, 64, 32\].*expects \[4, 32, 64\]"):
        LLM(path, dtype="float32", device="cpu")


@pytest.mark.parametrize("top_k,num_tokens", [(1, 5), (2, 7), (3, 1), (2, 0)])
def test_moe_block_router_weight_on_input(top_k, num_tokens):
    """MoEBlock(apply_router_weight_on_input=True) = sum over the chosen experts of
    expert_e(w_e * x) (+ the shared expert), for top-1 and top-k > 1, one token and none."""
    import functools

    import torch.nn.functional as F

    from models.layers.linear import ReplicatedLinear
    from models.layers.mlp import SwiGLUMLP
    from models.layers.moe import FusedMoE, MoEBlock
    from routing.llama4_router import llama4_topk

    torch.manual_seed(top_k)
    E, D, Fi = 4, 16, 8
    block = MoEBlock(gate=ReplicatedLinear(D, E), router_fn=functools.partial(llama4_topk, top_k=top_k),
                     experts=FusedMoE(E, D, Fi), shared_experts=SwiGLUMLP(D, Fi),
                     apply_router_weight_on_input=True)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    x = torch.randn(num_tokens, D)
    routing = llama4_topk(block.gate(x), top_k)
    want = block.shared_experts(x)
    for t in range(num_tokens):
        for w, e in zip(routing.topk_weights_TK[t], routing.topk_ids_TK[t].tolist()):
            gate, up = (block.experts.w13_weight[e] @ (w * x[t])).chunk(2)
            want[t] += block.experts.w2_weight[e] @ (F.silu(gate) * up)
    torch.testing.assert_close(block(x), want, atol=1e-5, rtol=1e-5)
