"""Tiny random Qwen3-Next and Qwen3.5-MoE checkpoints (hybrid Gated DeltaNet / gated attention)
built with Hugging Face transformers."""
from __future__ import annotations

import os

import torch
from tests.factories import perturb_norms, save_tokenizer, take_saved_tensors, write_safetensors

# Three linear-attention layers before each full one (full_attention_interval 4, as the real models),
# GQA in both kinds (2 key heads for 4 value heads; 4 query heads for 2 KV heads), a shared expert.
QWEN3_NEXT_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=40, full_attention_interval=4,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0,
)


def perturb_linear_attention(model: torch.nn.Module, seed: int = 0) -> None:
    """A_log and dt_bias away from their init (dt_bias is all ones), so a decay computed wrongly shows
    (decays kept moderate so that states neither vanish nor saturate within short prompts); the short
    convolution's taps large enough (init: std 0.02) that a tap or a carried conv state lost shows."""
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def make_qwen3_next_checkpoint(path: str, arch: str = "qwen3_next", layout: str = "hub", shards: int = 1,
                               seed: int = 0, **overrides) -> str:
    """Save a random transformers Qwen3NextForCausalLM (arch "qwen3_next") or Qwen3_5MoeForCausalLM
    ("qwen3_5_moe") to `path`. layout "hub": the names save_pretrained writes (per-expert
    mlp.experts.{e}.gate_proj ...); "fused": transformers' in-memory ones (mlp.experts.gate_up_proj
    [E, 2F, D], down_proj [E, D, F])."""
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig as Config
        from transformers import Qwen3NextForCausalLM as Model
    elif arch == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as Model
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig as Config
    else:
        raise ValueError(f"unknown arch {arch!r}")
    fields = {**QWEN3_NEXT_TINY, **overrides}
    if arch == "qwen3_5_moe":
        fields.pop("intermediate_size")  # every Qwen3.5-MoE layer is sparse
    torch.manual_seed(seed)
    model = Model(Config(**fields)).float().eval()
    perturb_norms(model, seed)
    perturb_linear_attention(model, seed)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tensors = take_saved_tensors(path)
    if layout == "fused":
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    write_safetensors(path, tensors, shards)
    save_tokenizer(path, fields["vocab_size"])
    return path
