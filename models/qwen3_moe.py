"""Qwen3-MoE (`Qwen3MoeForCausalLM`): GQA attention with per-head q/k RMSNorm before NeoX RoPE,
softmax top-k routing (optionally renormalised), no shared expert, dense MLP layers where
`mlp_only_layers` / `decoder_sparse_step` say so."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from models.config import ModelConfig, check_moe_fields, hf_get
from models.layers.attention import Attention
from models.layers.decoder import DecoderForCausalLM, DecoderStack, PreNormDecoderLayer
from models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from models.layers.mlp import SwiGLUMLP
from models.layers.moe import FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.loader import GATE_UP_RULES, QKV_RULES, NameRule
from models.parallel.pipeline import tied_lm_head_rules
from routing import softmax_topk


@dataclass
class Qwen3MoeConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "Qwen3MoeConfig":
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            # transformers would then use a sliding-window mask on every layer; running full
            # attention instead would silently change the outputs.
            raise ValueError(f"use_sliding_window=True (sliding window {cfg['sliding_window']}) is not supported "
                             "for Qwen3-MoE yet")
        config = cls(
            **cls.common_fields(cfg, architecture),
            num_experts=int(hf_get(cfg, "num_experts", "num_local_experts")),
            num_experts_per_tok=int(hf_get(cfg, "num_experts_per_tok")),
            moe_intermediate_size=int(hf_get(cfg, "moe_intermediate_size")),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []],
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
        check_moe_fields("num_experts", config.num_experts, config.num_experts_per_tok)
        return config

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeAttention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary_emb = get_rope(d, cfg.rope_max_position, cfg.rope)
        self.attn = Attention(self.qkv_proj.num_heads, d, self.qkv_proj.num_kv_heads, d ** -0.5)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q, k = q.reshape(T, -1, d), k.reshape(T, -1, d)
        # q_norm / k_norm per head, then RoPE: one launch on CUDA, which also writes the KV cache
        # when the Triton attention reads it (a launch per layer fewer)
        kv_write = self.attn.kv_write_args(q, meta) if self.rotary_emb.fuses_qk_norm(q, self.q_norm, self.k_norm) \
            else None
        if kv_write is not None:
            kv_write["v_TGd"] = v.reshape(T, -1, d)
        q, k = self.rotary_emb.forward_with_qk_norm(positions, q, k, self.q_norm, self.k_norm, kv_write)
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta, kv_written=kv_write is not None))


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__()
        self.self_attn = Qwen3MoeAttention(cfg)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoEBlock(
                gate=ReplicatedLinear(cfg.hidden_size, cfg.num_experts),
                router_fn=functools.partial(softmax_topk, top_k=cfg.num_experts_per_tok,
                                            renormalize=cfg.norm_topk_prob),
                experts=FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_parallel),
            )
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

class Qwen3MoeModel(DecoderStack):
    def __init__(self, cfg: Qwen3MoeConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: Qwen3MoeDecoderLayer(cfg, i, moe_parallel))


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, cfg: Qwen3MoeConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__(cfg, Qwen3MoeModel(cfg, moe_parallel))

    def weight_name_rules(self) -> list[NameRule]:
        return tied_lm_head_rules(self.config.tie_word_embeddings) + [
            NameRule("experts.w13_weight", "experts.{e}.gate_proj.weight", "w1"),
            NameRule("experts.w13_weight", "experts.{e}.up_proj.weight", "w3"),
            NameRule("experts.w2_weight", "experts.{e}.down_proj.weight", "w2"),
            NameRule("experts.w13_weight", "experts.gate_up_proj", "w13"),
            NameRule("experts.w2_weight", "experts.down_proj", "w2"),
        ] + QKV_RULES + GATE_UP_RULES
