"""Tiny random MiniMax-M2 checkpoints built with transformers (fp32), plain or FP8 block-quantised."""
from __future__ import annotations

import json
import os

import torch

from tests.factories import perturb_norms, save_tokenizer, take_saved_tensors, write_safetensors
from tests.factories_deepseek import quantize_with_twin

# Partial RoPE (8 of 16 dims), 8 experts top-2, every layer MoE.
MINIMAX_M2_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    eos_token_id=0, bos_token_id=1,
)

# What the hub's config.json has beyond transformers' fields (the values our model requires).
HUB_FIELDS = dict(qk_norm_type="per_layer", use_qk_norm=True, scoring_func="sigmoid", use_routing_bias=True,
                  shared_intermediate_size=0, use_mtp=True, num_mtp_modules=1, mtp_transformer_layers=1)
HUB_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                    "weight_block_size": [128, 128],
                    "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def is_fp8_weight(name: str) -> bool:
    """The tensors the MiniMax-M2 hub stores in FP8: attention projections and expert weights."""
    return name.endswith("proj.weight") or (".experts." in name and name.endswith(("w1.weight", "w2.weight",
                                                                                       "w3.weight")))


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Norms away from 1; router logits large enough that the sigmoid scores differ, and a correction
    bias of comparable size, so that both choose experts and a missing one would show."""
    perturb_norms(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))


def _mtp_tensors(cfg) -> dict:
    """Fake multi-token-prediction tensors (layer index = num_hidden_layers), to be ignored on load."""
    n, D = cfg.num_hidden_layers, cfg.hidden_size
    return {f"model.layers.{n}.self_attn.q_proj.weight": torch.randn(cfg.num_attention_heads * cfg.head_dim, D),
            f"model.layers.{n}.block_sparse_moe.experts.0.w1.weight": torch.randn(cfg.intermediate_size, D),
            "model.mtp.0.enorm.weight": torch.ones(D)}


def _edit_config(path: str, hub_config: bool, quantized: bool) -> None:
    """hub_config: the released checkpoints' style (legacy `rope_theta` + `rotary_dim`, no
    rope_parameters, the extra MiniMax fields); quantized: their FP8 quantization_config."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        raw = json.load(f)
    if hub_config:
        rope = raw.pop("rope_parameters")
        raw.update(HUB_FIELDS, rope_theta=rope["rope_theta"], rotary_dim=int(raw["head_dim"]
                                                                             * rope["partial_rotary_factor"]))
    if quantized:
        raw["quantization_config"] = HUB_QUANTIZATION
    with open(file, "w") as f:
        json.dump(raw, f, indent=2)


def make_minimax_m2_checkpoint(path: str, seed: int = 0, shards: int = 1, layout: str = "hub", mtp: bool = False,
                               hub_config: bool = False, fp8_twin_path: str | None = None,
                               with_tokenizer: bool = True, **overrides) -> str:
    """Save a random transformers MiniMax-M2 to `path` (fp32).

    layout: "hub" (what save_pretrained writes, as the hub: block_sparse_moe.experts.{e}.w1 / w3 / w2)
    or "fused" (transformers' in-memory names: mlp.gate, mlp.e_score_correction_bias, 3-D
    mlp.experts.gate_up_proj [E, 2F, D] / down_proj [E, D, F]).
    mtp: add fake multi-token-prediction tensors (must be ignored on load).
    fp8_twin_path: instead save at `path` an FP8 e4m3 128x128 block-quantised checkpoint (hub
    quantization_config, `*.weight_scale_inv` beside each quantised weight) and at
    `fp8_twin_path` its dequantised fp32 twin (what transformers loads).
    """
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    torch.manual_seed(seed)
    config = MiniMaxM2Config(**{**MINIMAX_M2_TINY, **overrides})
    model = MiniMaxM2ForCausalLM(config).float().eval()
    _perturb(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tensors = take_saved_tensors(path)
    if layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()
                   if not (config.tie_word_embeddings and k == "lm_head.weight")}  # shared with the embedding
    assert any(k.endswith("e_score_correction_bias") for k in tensors)
    if fp8_twin_path is not None:
        twin = quantize_with_twin(tensors, is_fp8_weight)
        os.makedirs(fp8_twin_path, exist_ok=True)
        for f in os.listdir(path):
            if f.endswith(".json"):
                with open(os.path.join(path, f)) as src, open(os.path.join(fp8_twin_path, f), "w") as dst:
                    dst.write(src.read())
        _edit_config(fp8_twin_path, hub_config, quantized=False)
        write_safetensors(fp8_twin_path, twin)
        if with_tokenizer:
            save_tokenizer(fp8_twin_path, config.vocab_size)
    _edit_config(path, hub_config, quantized=fp8_twin_path is not None)
    if mtp:
        tensors.update(_mtp_tensors(config))
    write_safetensors(path, tensors, shards)
    if with_tokenizer:
        save_tokenizer(path, config.vocab_size)
    return path
