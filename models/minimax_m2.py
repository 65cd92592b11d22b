"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): GQA attention whose q/k RMSNorm spans the whole projection
(all heads together, `qk_norm_type: per_layer`) before partial NeoX RoPE (`rotary_dim` of `head_dim`),
every layer a sparse MoE block with DeepSeek-V3's sigmoid router (correction bias for selection only,
weights from the unbiased scores, renormalised, no scaling factor), no shared expert, FP8 128x128
block-quantised hub weights (served as DeepSeek-V3's: models/fp8.py), multi-token-prediction layers of
the checkpoint ignored.

Under tensor parallelism the q/k norm's mean of squares spans heads held by other ranks: each rank
sums its part and one all-reduce per layer adds q's and k's partial sums (`all_heads_qk_norm`).

Hub tensors (also what transformers' save_pretrained writes): `block_sparse_moe.gate`,
`block_sparse_moe.e_score_correction_bias`, `block_sparse_moe.experts.{e}.w1 / w3 / w2` (gate, up,
down; `.weight_scale_inv` beside each FP8 weight). transformers' in-memory names (`mlp.gate`,
`mlp.e_score_correction_bias`, fused 3-D `mlp.experts.gate_up_proj` / `down_proj`) load too.

Legend: T tokens, D hidden, E experts, Q / K this rank's q / k projection width.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

from kernels import batch_invariant
from kernels.attention import AttentionMetadata
from models.config import ModelConfig, check_moe_fields, hf_get
from models.fp8 import Fp8BlockConfig, attach_fp8_scales, block_fp8_params, experts_fp8_block
from models.layers.attention import Attention
from models.layers.decoder import DecoderForCausalLM, DecoderStack, PreNormDecoderLayer
from models.layers.linear import QKVParallelLinear, RowParallelLinear
from models.layers.moe import FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.layers.weights import ReplicatedLoader, Shard, ShardedLoader, attach_loader, new_param
from models.loader import QKV_RULES, NameRule
from models.parallel.pipeline import tied_lm_head_rules
from models.parallel.state import get_parallel_state, tp_all_reduce
from routing.grouped_topk import grouped_topk
from routing.router import RouterOutput


def _rotary_dim(cfg: dict, head_dim: int) -> int:
    """transformers' precedence: rope_parameters.partial_rotary_factor, then a top-level
    partial_rotary_factor, then the released checkpoints' legacy `rotary_dim`, else the whole head."""
    rope = cfg.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if factor is None:
        rotary = cfg.get("rotary_dim")
        factor = rotary / head_dim if rotary else 1.0
    dim = int(head_dim * float(factor))
    if not 0 < dim <= head_dim or dim % 2:
        raise ValueError(f"rotary dimension {dim} (rotary_dim / partial_rotary_factor) must be even and within "
                         f"head_dim={head_dim}")
    return dim


def _refuse_unsupported(cfg: dict) -> None:
    """Fields of MiniMax configs that would change the maths here (transformers' model ignores them
    and computes what the released MiniMax-M2 needs): refused rather than run differently."""
    expected = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                "use_routing_bias": True, "norm_topk_prob": True}
    for key, want in expected.items():
        if key in cfg and cfg[key] is not None and cfg[key] != want:
            raise ValueError(f"{key}={cfg[key]!r} is not supported for MiniMax-M2 (only {want!r})")
    scaling = cfg.get("routed_scaling_factor")
    if scaling is not None and float(scaling) != 1.0:
        raise ValueError(f"routed_scaling_factor={scaling} is not supported for MiniMax-M2 (only 1.0)")
    shared = int(cfg.get("shared_intermediate_size") or 0) or int(cfg.get("n_shared_experts") or 0)
    if shared:
        raise ValueError("a shared expert (shared_intermediate_size / n_shared_experts > 0) is not supported for "
                         "MiniMax-M2")
    attn_types = cfg.get("attn_type_list") or []
    if any(int(t) != 1 for t in attn_types):
        raise ValueError("attn_type_list has layers of linear (lightning) attention (type 0): only full softmax "
                         "attention (type 1) is supported for MiniMax-M2")


@dataclass
class MiniMaxM2Config(ModelConfig):
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    rotary_dim: int = 0
    fp8: Fp8BlockConfig | None = None

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "MiniMaxM2Config":
        _refuse_unsupported(cfg)
        common = cls.common_fields(cfg, architecture)
        if common["rope"].scaling_type != "default":
            raise ValueError(f"rope type {common['rope'].scaling_type!r} is not supported for MiniMax-M2 "
                             "(only 'default')")
        config = cls(
            **common,
            num_local_experts=int(hf_get(cfg, "num_local_experts", "num_experts")),
            num_experts_per_tok=int(hf_get(cfg, "num_experts_per_tok")),
            # Every layer is MoE: `intermediate_size` is the experts' width.
            moe_intermediate_size=int(hf_get(cfg, "intermediate_size")),
            rotary_dim=_rotary_dim(cfg, common["head_dim"]),
            fp8=Fp8BlockConfig.from_hf(cfg),
        )
        check_moe_fields("num_local_experts", config.num_local_experts, config.num_experts_per_tok)
        return config


class AllHeadsRMSNorm(RMSNorm):
    """RMSNorm over a whole q or k projection (all heads together), holding this TP rank's slice
    of the weight: `shard`, the slice of the projection's output this rank computes."""

    def __init__(self, shard: Shard, eps: float) -> None:
        nn.Module.__init__(self)
        self.eps = eps
        piece = Shard(shard.full, shard.ckpt_start, shard.size, 0)
        self.weight = attach_loader(new_param(shard.size), ShardedLoader((shard.size,), 0, {None: piece}))

    def scale(self, x_TW: torch.Tensor, mean_sq_T: torch.Tensor) -> torch.Tensor:
        """The norm of x given its rows' mean of squares over the whole projection (fp32 [T])."""
        h = x_TW.float() * torch.rsqrt(mean_sq_T[:, None] + self.eps)
        return self.weight * h.to(x_TW.dtype)


def all_heads_qk_norm(q_TQ: torch.Tensor, k_TK: torch.Tensor, q_norm: AllHeadsRMSNorm, k_norm: AllHeadsRMSNorm,
                      tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_norm(q), k_norm(k) for this rank's heads of q [T, Q] and k [T, K]."""
    if tp_size == 1:  # the shared RMSNorm kernels (Triton on CUDA, native on the CPU)
        return q_norm(q_TQ), k_norm(k_TK)
    # One all-reduce adds both partial sums of squares. A KV head replicated on r ranks (fewer KV
    # heads than ranks) is counted r times in k's sum, and so in tp_size * K: the ratio is the mean.
    sums_T2 = tp_all_reduce(torch.stack([q_TQ.float().pow(2).sum(-1), k_TK.float().pow(2).sum(-1)], dim=-1))
    return (q_norm.scale(q_TQ, sums_T2[:, 0] / (tp_size * q_TQ.shape[-1])),
            k_norm.scale(k_TK, sums_T2[:, 1] / (tp_size * k_TK.shape[-1])))


class MiniMaxM2Attention(nn.Module):
    def __init__(self, cfg: MiniMaxM2Config) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size)
        shards = self.qkv_proj.weight.param_loader.shards
        self.q_norm = AllHeadsRMSNorm(shards["q"], cfg.rms_norm_eps)
        self.k_norm = AllHeadsRMSNorm(shards["k"], cfg.rms_norm_eps)
        self.rotary_emb = get_rope(d, cfg.rope_max_position, cfg.rope, rotary_dim=cfg.rotary_dim)
        self.attn = Attention(self.qkv_proj.num_heads, d, self.qkv_proj.num_kv_heads, d ** -0.5)
        self.head_dim, self.tp_size = d, get_parallel_state().tp_size

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        # Not Qwen3's fused per-head norm + RoPE launch: this norm spans the heads, so it runs first.
        q, k = all_heads_qk_norm(q, k, self.q_norm, self.k_norm, self.tp_size)
        q, k = self.rotary_emb(positions, q.reshape(T, -1, d), k.reshape(T, -1, d))
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta))


class MiniMaxM2Gate(nn.Module):
    """Router logits in fp32 (weight [E, D] and the correction bias [E] fp32, as the hub stores
    them); `route` turns them into top-k: sigmoid scores, bias added to choose, weights renormalised."""

    def __init__(self, cfg: MiniMaxM2Config) -> None:
        super().__init__()
        E, D = cfg.num_local_experts, cfg.hidden_size
        self.weight = attach_loader(new_param(E, D, dtype=torch.float32), ReplicatedLoader((E, D)))
        self.e_score_correction_bias = attach_loader(new_param(E, dtype=torch.float32), ReplicatedLoader((E,)))
        self._route = functools.partial(grouped_topk, top_k=cfg.num_experts_per_tok, renormalize=True,
                                        scoring_func="sigmoid")  # one group: plain top-k

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return batch_invariant.dense(x_TD.float(), self.weight)

    def route(self, logits_TE: torch.Tensor) -> RouterOutput:
        return self._route(logits_TE, e_score_correction_bias_E=self.e_score_correction_bias)


class MiniMaxM2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: MiniMaxM2Config, layer_idx: int, moe_parallel: MoEParallelConfig) -> None:
        super().__init__()
        self.self_attn = MiniMaxM2Attention(cfg)
        gate = MiniMaxM2Gate(cfg)
        experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_parallel,
                           top_k=cfg.num_experts_per_tok, fp8_block=experts_fp8_block(cfg.fp8, layer_idx))
        self.mlp = MoEBlock(gate=gate, router_fn=gate.route, experts=experts)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MiniMaxM2Model(DecoderStack):
    def __init__(self, cfg: MiniMaxM2Config, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: MiniMaxM2DecoderLayer(cfg, i, moe_parallel))


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    config_class = MiniMaxM2Config
    supports_fp8_experts = True  # experts can stay FP8 (models/fp8.resolve_fp8_experts)

    def __init__(self, cfg: MiniMaxM2Config, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__(cfg, MiniMaxM2Model(cfg, moe_parallel))
        if cfg.fp8 is not None:
            attach_fp8_scales(self, cfg.fp8, block_fp8_params)

    def weight_name_rules(self) -> list[NameRule]:
        rules = tied_lm_head_rules(self.config.tie_word_embeddings)
        for suffix in ("_scale_inv", ""):  # scales first: their names extend the weights'
            rules += [
                NameRule(f"mlp.experts.w13_weight{suffix}", f"block_sparse_moe.experts.{{e}}.w1.weight{suffix}", "w1"),
                NameRule(f"mlp.experts.w13_weight{suffix}", f"block_sparse_moe.experts.{{e}}.w3.weight{suffix}", "w3"),
                NameRule(f"mlp.experts.w2_weight{suffix}", f"block_sparse_moe.experts.{{e}}.w2.weight{suffix}", "w2"),
            ]
        return rules + [
            NameRule("mlp.experts.w13_weight", "mlp.experts.gate_up_proj", "w13"),
            NameRule("mlp.experts.w2_weight", "mlp.experts.down_proj", "w2"),
            # The bias sits beside the gate in checkpoints, inside it here (the router uses it).
            NameRule("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
            NameRule("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias"),
            NameRule("mlp.gate", "block_sparse_moe.gate"),
        ] + QKV_RULES

    _LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    _MTP = re.compile(r"(?:^|\.)mtp[^.]*\.")

    def ignore_checkpoint_name(self, name: str) -> bool:
        m = self._LAYER.search(name)
        if (m and int(m.group(1)) >= self.config.num_hidden_layers) or self._MTP.search(name):
            return True  # multi-token-prediction modules (and anything past the model's depth)
        return super().ignore_checkpoint_name(name)
