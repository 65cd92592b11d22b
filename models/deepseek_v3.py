"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention (latent + shared rope key
cached, YaRN with mscale^2 in the softmax scale, interleaved RoPE), sigmoid group-limited top-k
routing with a selection-only correction bias, shared experts beside the routed ones, the first
`first_k_dense_replace` layers dense, FP8 128x128 block-quantised hub weights (dequantised at
load, except the routed experts where the engine keeps them FP8: `Fp8BlockConfig.keep_experts`),
multi-token-prediction layers of the checkpoint ignored."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels import batch_invariant
from models.config import ModelConfig, check_moe_fields, hf_get
from models.fp8 import Fp8BlockConfig, attach_fp8_scales, block_fp8_params, experts_fp8_block
from models.layers.decoder import DecoderForCausalLM, DecoderStack, PreNormDecoderLayer
from models.layers.mla_attention import MLAAttention, MLAConfig
from models.layers.mlp import SwiGLUMLP
from models.layers.moe import FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.weights import ReplicatedLoader, attach_loader, new_param
from models.loader import EXPERT_RULES, GATE_UP_RULES, NameRule
from models.parallel.pipeline import skip_other_stage_tensor, tied_lm_head_rules
from routing.grouped_topk import grouped_topk
from routing.router import RouterOutput


@dataclass
class DeepseekV3Config(ModelConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope_interleave: bool = True
    attention_bias: bool = False
    fp8: Fp8BlockConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "DeepseekV3Config":
        common = cls.common_fields(cfg, architecture)
        nope, rope = int(hf_get(cfg, "qk_nope_head_dim")), int(hf_get(cfg, "qk_rope_head_dim"))
        # transformers writes head_dim = qk_rope_head_dim; the engine's head dim is the q/k one.
        # Every head has its own K/V once the latent is expanded: as many KV heads as heads.
        common.update(head_dim=nope + rope, num_key_value_heads=common["num_attention_heads"])
        q_lora = cfg.get("q_lora_rank")
        n_group = int(cfg.get("n_group") or 1)
        scoring = str(cfg.get("scoring_func", "sigmoid") or "sigmoid")
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func={scoring!r} is not supported (sigmoid, softmax)")
        config = cls(
            **common,
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(hf_get(cfg, "kv_lora_rank")),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(hf_get(cfg, "v_head_dim")),
            moe_intermediate_size=int(hf_get(cfg, "moe_intermediate_size")),
            n_routed_experts=int(cfg.get("n_routed_experts") or 0),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
            n_group=n_group,
            topk_group=int(cfg.get("topk_group") or n_group),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            scoring_func=scoring,
            first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(cfg.get("moe_layer_freq") or 1),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            fp8=Fp8BlockConfig.from_hf(cfg),
        )
        check_moe_fields("n_routed_experts", config.n_routed_experts, config.num_experts_per_tok, config.n_group,
                         config.topk_group)
        return config

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    def mla(self) -> MLAConfig:
        return MLAConfig(self.hidden_size, self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank,
                         self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                         self.rope_max_position, self.rope, self.rope_interleave, self.attention_bias)


class DeepseekV3Gate(nn.Module):
    """Router logits in fp32 (weight [E, D] and the correction bias [E] stay fp32 whatever the
    model dtype, as in transformers); `route` turns them into top-k."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        E, D = cfg.n_routed_experts, cfg.hidden_size
        self.weight = attach_loader(new_param(E, D, dtype=torch.float32), ReplicatedLoader((E, D)))
        self.e_score_correction_bias = attach_loader(new_param(E, dtype=torch.float32), ReplicatedLoader((E,)))
        self._route = functools.partial(
            grouped_topk, top_k=cfg.num_experts_per_tok, num_expert_group=cfg.n_group,
            topk_group=cfg.topk_group, renormalize=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor, scoring_func=cfg.scoring_func)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return batch_invariant.dense(x_TD.float(), self.weight)

    def route(self, logits_TE: torch.Tensor) -> RouterOutput:
        return self._route(logits_TE, e_score_correction_bias_E=self.e_score_correction_bias)


def deepseek_mlp(cfg, layer_idx: int, moe_parallel: MoEParallelConfig | None) -> nn.Module:
    """A layer's MLP in DeepSeek-V3's form (GLM-4.5 shares it): past the first_k_dense_replace dense
    layers, the sigmoid router with correction bias and groups, the routed experts (FP8 where the
    checkpoint's are) and the shared ones."""
    if not cfg.is_moe_layer(layer_idx):
        return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
    gate = DeepseekV3Gate(cfg)
    shared = (SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
              if cfg.n_shared_experts else None)
    experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_parallel,
                       fp8_block=experts_fp8_block(cfg.fp8, layer_idx))
    return MoEBlock(gate=gate, router_fn=gate.route, experts=experts, shared_experts=shared)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, attn_mode: str = "auto",
                 moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg.mla(), attn_mode)
        self.mlp = deepseek_mlp(cfg, layer_idx, moe_parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

class DeepseekV3Model(DecoderStack):
    def __init__(self, cfg: DeepseekV3Config, attn_mode: str = "auto",
                 moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: DeepseekV3DecoderLayer(cfg, i, attn_mode, moe_parallel))


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    config_class = DeepseekV3Config
    supports_fp8_experts = True  # routed experts can stay FP8 (models/fp8.resolve_fp8_experts)

    def __init__(self, cfg: DeepseekV3Config, attn_mode: str = "auto",
                 moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__(cfg, DeepseekV3Model(cfg, attn_mode, moe_parallel))
        if cfg.fp8 is not None:
            attach_fp8_scales(self, cfg.fp8, block_fp8_params)

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn for layer in self.model.stage_layers()]

    def weight_name_rules(self) -> list[NameRule]:
        return tied_lm_head_rules(self.config.tie_word_embeddings) + EXPERT_RULES + GATE_UP_RULES

    _LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

    def ignore_checkpoint_name(self, name: str) -> bool:
        m = self._LAYER.search(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return True  # multi-token-prediction layers (and anything past the model's depth)
        tied = self.config.tie_word_embeddings
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            return True
        return skip_other_stage_tensor(name, self, tied)
