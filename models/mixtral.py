"""Mixtral (`MixtralForCausalLM`): Llama's GQA attention (no biases, no q/k norms, NeoX RoPE) and in
every layer a sparse MoE block: a softmax router choosing top-k experts (2 in the released models)
whose weights are renormalised over the chosen ones, SwiGLU experts of `intermediate_size`.

Hub tensors are `block_sparse_moe.gate` and `block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate, up,
down); transformers holds them as `mlp.gate` and fused 3-D `mlp.experts.gate_up_proj` / `down_proj`,
which load too. A `sliding_window` (Mistral's releases set it null or past the context) makes every
layer a sliding-window one; its KV stays in the full-attention group (no layer keeps the whole past).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from models.config import ModelConfig, check_moe_fields, hf_get
from models.layers.attention import Attention
from models.layers.decoder import DecoderForCausalLM, DecoderStack, PreNormDecoderLayer
from models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from models.layers.moe import FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.loader import QKV_RULES, NameRule
from models.parallel.pipeline import tied_lm_head_rules
from routing import softmax_topk


@dataclass
class MixtralConfig(ModelConfig):
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    sliding_window: int | None = None  # None: full attention (also for a window past the context)

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "MixtralConfig":
        window = cfg.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
            raise ValueError(f"sliding_window={window!r} must be a positive integer or null")
        max_position = int(hf_get(cfg, "max_position_embeddings"))
        config = cls(**cls.common_fields(cfg, architecture),
                     num_local_experts=int(hf_get(cfg, "num_local_experts")),
                     num_experts_per_tok=int(hf_get(cfg, "num_experts_per_tok")),
                     sliding_window=window if window is not None and window < max_position else None)
        check_moe_fields("num_local_experts", config.num_local_experts, config.num_experts_per_tok)
        return config


class MixtralAttention(nn.Module):
    def __init__(self, cfg: MixtralConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size)
        self.rotary_emb = get_rope(d, cfg.rope_max_position, cfg.rope)
        self.attn = Attention(self.qkv_proj.num_heads, d, self.qkv_proj.num_kv_heads, d ** -0.5,
                              sliding_window=cfg.sliding_window)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q, k = self.rotary_emb(positions, q.reshape(T, -1, d), k.reshape(T, -1, d))
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta))


class MixtralDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: MixtralConfig, moe_parallel: MoEParallelConfig) -> None:
        super().__init__()
        self.self_attn = MixtralAttention(cfg)
        self.mlp = MoEBlock(
            gate=ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts),
            router_fn=functools.partial(softmax_topk, top_k=cfg.num_experts_per_tok, renormalize=True),
            experts=FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, moe_parallel),
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MixtralModel(DecoderStack):
    def __init__(self, cfg: MixtralConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: MixtralDecoderLayer(cfg, moe_parallel))


class MixtralForCausalLM(DecoderForCausalLM):
    config_class = MixtralConfig

    def __init__(self, cfg: MixtralConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__(cfg, MixtralModel(cfg, moe_parallel))

    def weight_name_rules(self) -> list[NameRule]:
        return tied_lm_head_rules(self.config.tie_word_embeddings) + [
            NameRule("mlp.experts.w13_weight", "block_sparse_moe.experts.{e}.w1.weight", "w1"),
            NameRule("mlp.experts.w13_weight", "block_sparse_moe.experts.{e}.w3.weight", "w3"),
            NameRule("mlp.experts.w2_weight", "block_sparse_moe.experts.{e}.w2.weight", "w2"),
            NameRule("mlp.gate", "block_sparse_moe.gate"),
            NameRule("experts.w13_weight", "experts.gate_up_proj", "w13"),
            NameRule("experts.w2_weight", "experts.down_proj", "w2"),
        ] + QKV_RULES
