"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): GQA attention with q/k/v biases (`attention_bias`; o_proj
has none), optional per-head q/k RMSNorm (`use_qk_norm`) before partial NeoX RoPE (the first
head_dim * `partial_rotary_factor` dims of each head rotate, halves rotated against each other, the
rest pass through), DeepSeek-V3's router (sigmoid scores, selection-only correction bias,
group-limited top-k, optional renormalisation, `routed_scaling_factor`), shared experts beside the
routed ones, the first `first_k_dense_replace` layers dense, FP8 128x128 block-quantised
checkpoints as DeepSeek-V3's (models/fp8.py), multi-token-prediction layers of the checkpoint
(`num_nextn_predict_layers`, indices >= num_hidden_layers) ignored."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from models.config import ModelConfig, check_moe_fields, hf_get
from models.deepseek_v3 import deepseek_mlp
from models.fp8 import Fp8BlockConfig, attach_fp8_scales, block_fp8_params
from models.layers.attention import Attention
from models.layers.decoder import DecoderForCausalLM, DecoderStack, PreNormDecoderLayer
from models.layers.linear import QKVParallelLinear, RowParallelLinear
from models.layers.moe import MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.loader import EXPERT_RULES, GATE_UP_RULES, NameRule, QKV_RULES
from models.parallel.pipeline import tied_lm_head_rules

# transformers' Glm4MoeConfig sets this when config.json has no partial_rotary_factor.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


@dataclass
class Glm4MoeConfig(ModelConfig):
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"  # always sigmoid for GLM; DeepseekV3Gate reads it
    first_k_dense_replace: int = 1
    attention_bias: bool = False
    use_qk_norm: bool = False
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    fp8: Fp8BlockConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "Glm4MoeConfig":
        # Defaults where config.json omits a field are transformers' Glm4MoeConfig defaults.
        n_group = int(cfg.get("n_group") or 1)
        # The hub's config.json has partial_rotary_factor at the top level, transformers 5 saves it
        # inside rope_parameters.
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        factor = float(DEFAULT_PARTIAL_ROTARY_FACTOR if factor is None else factor)
        config = cls(
            **cls.common_fields(cfg, architecture),
            moe_intermediate_size=int(hf_get(cfg, "moe_intermediate_size")),
            n_routed_experts=int(hf_get(cfg, "n_routed_experts", "num_local_experts")),
            n_shared_experts=int(cfg.get("n_shared_experts", 1) or 0),
            num_experts_per_tok=int(hf_get(cfg, "num_experts_per_tok")),
            n_group=n_group,
            topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            first_k_dense_replace=int(cfg.get("first_k_dense_replace", 1) or 0),
            attention_bias=bool(cfg.get("attention_bias", False)),
            use_qk_norm=bool(cfg.get("use_qk_norm", False)),
            partial_rotary_factor=factor,
            fp8=Fp8BlockConfig.from_hf(cfg),
        )
        rot = config.rotary_dim
        if not 0 < rot <= config.head_dim or rot % 2:
            raise ValueError(f"partial_rotary_factor={factor} gives {rot} rotary dims of head_dim={config.head_dim}: "
                             "they must be even and between 2 and head_dim")
        check_moe_fields("n_routed_experts", config.n_routed_experts, config.num_experts_per_tok, config.n_group,
                         config.topk_group)
        return config

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # truncated, as transformers does

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace


class Glm4MoeAttention(nn.Module):
    def __init__(self, cfg: Glm4MoeConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=False)
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.use_qk_norm = cfg.use_qk_norm
        self.rotary_emb = get_rope(d, cfg.rope_max_position, cfg.rope, rotary_dim=cfg.rotary_dim)
        self.attn = Attention(self.qkv_proj.num_heads, d, self.qkv_proj.num_kv_heads, d ** -0.5)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q, k = q.reshape(T, -1, d), k.reshape(T, -1, d)
        if not self.use_qk_norm:
            q, k = self.rotary_emb(positions, q, k)
            return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta))
        # As Qwen3-MoE: norms and RoPE in one launch on CUDA, which also writes the KV cache there.
        kv_write = self.attn.kv_write_args(q, meta) if self.rotary_emb.fuses_qk_norm(q, self.q_norm, self.k_norm) \
            else None
        if kv_write is not None:
            kv_write["v_TGd"] = v.reshape(T, -1, d)
        q, k = self.rotary_emb.forward_with_qk_norm(positions, q, k, self.q_norm, self.k_norm, kv_write)
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta, kv_written=kv_write is not None))


class Glm4MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: Glm4MoeConfig, layer_idx: int, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__()
        self.self_attn = Glm4MoeAttention(cfg)
        self.mlp = deepseek_mlp(cfg, layer_idx, moe_parallel)  # DeepSeek-V3's router maths and checkpoint names
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Glm4MoeModel(DecoderStack):
    def __init__(self, cfg: Glm4MoeConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: Glm4MoeDecoderLayer(cfg, i, moe_parallel))


class Glm4MoeForCausalLM(DecoderForCausalLM):
    config_class = Glm4MoeConfig
    supports_fp8_experts = True  # routed experts can stay FP8 (models/fp8.resolve_fp8_experts)

    def __init__(self, cfg: Glm4MoeConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__(cfg, Glm4MoeModel(cfg, moe_parallel))
        if cfg.fp8 is not None:
            attach_fp8_scales(self, cfg.fp8, block_fp8_params)

    def weight_name_rules(self) -> list[NameRule]:
        return tied_lm_head_rules(self.config.tie_word_embeddings) + EXPERT_RULES + QKV_RULES + GATE_UP_RULES

    _LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

    def ignore_checkpoint_name(self, name: str) -> bool:
        m = self._LAYER.search(name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return True  # multi-token-prediction layers (num_nextn_predict_layers)
        return super().ignore_checkpoint_name(name)
