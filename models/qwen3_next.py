"""Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, text only): hybrid
decoders whose `layer_types` mix "linear_attention" layers (Gated DeltaNet, a recurrent state per
sequence) and "full_attention" layers (gated attention, a KV cache), every layer followed by an MoE
block with a gated shared expert (or, Qwen3-Next, a dense MLP where `mlp_only_layers` /
`decoder_sparse_step` say so).

What differs from Qwen3-MoE:
- every RMSNorm but the Gated DeltaNet's output norm is zero-centred: out = norm(x_fp32) * (1 + w_fp32),
  cast to x's dtype; the checkpoint stores w (initialised to zeros).
- full attention: q_proj gives, per head, [query | gate] (2 * head_dim rows); the attention output is
  multiplied by sigmoid(gate) before o_proj. Per-head zero-centred q/k norms, then partial NeoX RoPE
  (the first head_dim * `partial_rotary_factor` dims of each head rotate). Qwen3.5's rope_parameters
  describe multimodal RoPE (`mrope_section`, `mrope_interleaved`): for text the three position
  components (time, height, width) are equal, so every frequency sees the token's position and the
  plain 1-D partial RoPE here computes the same rotation.
- linear attention (Gated DeltaNet): projections to q, k (linear_num_key_heads x linear_key_head_dim),
  v, z (linear_num_value_heads x linear_value_head_dim) and b, a (one each per value head); a depthwise
  causal conv (linear_conv_kernel_dim taps, no bias) + SiLU over the q|k|v channels; beta = sigmoid(b),
  g = -exp(A_log) * softplus(a + dt_bias) (fp32); the gated delta rule with L2-normalised q/k
  (kernels/gated_delta.py); the gated RMSNorm (weight * norm(o), times silu(z); its weight is not
  zero-centred); out_proj. Qwen3-Next's checkpoints fuse the projections as in_proj_qkvz
  [2 key_dim + 2 value_dim, D] and in_proj_ba [2 Hv, D] with rows grouped per key head (q_h, k_h, then
  the v and z rows of the head's Hv / Hk value heads; b then a likewise); Qwen3.5's are separate
  (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) in plain head order. Both load into one projection
  whose rows are plain q | k | v | z | b | a (the loader reorders), so the forward only splits.
- MoE: softmax top-k (`norm_topk_prob`; Qwen3.5 always renormalises), plus a shared expert whose output
  is scaled by sigmoid(shared_expert_gate(x)) (Linear(D, 1)). Experts per expert
  (`experts.{e}.gate_proj` ...) or transformers' fused 3-D `experts.gate_up_proj` / `down_proj`.
- recurrent state: each linear-attention module declares `state_shapes(num_slots)` (conv state
  [N, conv channels, K - 1] in the model dtype, SSM state [N, Hv, Dk, Dv] fp32); the model runner sets
  the zeroed pools as its `conv_state` / `ssm_state` and, per step, `AttentionMetadata.state_slots_B`
  and `has_initial_state_B` (scheduler/kv_cache_spec.py). `recurrent_layers()` lists them,
  `attention_layers()` only the full-attention layers' Attention modules.
- tensor parallelism: attention heads as elsewhere; Gated DeltaNet key and value heads both split over
  the TP ranks (each rank holds whole key-head groups: its q, k rows, the v, z, b, a rows of their value
  heads, the matching conv channels, A_log / dt_bias entries and out_proj columns).
- checkpoints: multi-token-prediction tensors (`mtp.*`) and a vision tower (`model.visual.*`) are not
  loaded. A multimodal config.json (text fields under `text_config`, as Qwen3_5MoeForConditionalGeneration
  saves it) builds the text model under `model.language_model`, matching that checkpoint's tensor names.

Legend: T tokens, D hidden, H / G attention / KV heads, Hk / Hv Gated DeltaNet key / value heads of
dims Dk / Dv, K conv taps.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import AttentionMetadata
from kernels.fla_gated_delta import PrefillSplit, fla_prefill_available, gated_delta_rule_prefill_split
from kernels.gated_delta import causal_conv1d_varlen, gated_delta_rule_varlen, rms_norm_gated

try:  # Triton is absent on some platforms; the torch reference then serves every device (use_triton_attention).
    from kernels.triton_gated_delta import causal_conv1d_varlen_triton, gated_delta_rule_recurrent_triton
    from kernels.triton_gated_delta_chunked import gated_delta_rule_chunked_triton
except ImportError:
    causal_conv1d_varlen_triton = gated_delta_rule_recurrent_triton = gated_delta_rule_chunked_triton = None
from kernels.triton_fused.moe_sum import TopKSum
from models.config import ModelConfig, check_moe_fields, hf_get
from models.layers.attention import Attention, use_triton_attention
from models.layers.decoder import DecoderForCausalLM, DecoderStack, PreNormDecoderLayer
from models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from models.layers.mlp import SwiGLUMLP
from models.layers.moe import FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.layers.weights import ParamLoader, ReplicatedLoader, Shard, attach_loader, new_param
from models.loader import EXPERT_RULES, GATE_UP_RULES, QKV_RULES, NameRule
from models.parallel.pipeline import last_stage, skip_other_stage_tensor, tied_lm_head_rules
from models.parallel.state import get_parallel_state
from routing import softmax_topk

logger = logging.getLogger("moe.models.qwen3_next")

LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' defaults where config.json omits them: partial_rotary_factor (Qwen3NextConfig and
# Qwen3_5MoeTextConfig) and the layer pattern's full_attention_interval.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
# Top-level keys of a multimodal config.json that the text model inherits when text_config lacks them.
_INHERITED_KEYS = ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings")
_LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim")
# Checkpoint prefixes never loaded: multi-token prediction and the multimodal checkpoints' vision tower.
_SKIPPED_PREFIXES = ("mtp.", "model.visual.")
PREFILL_MODES = ("chunked", "recurrent")


@functools.cache
def chunked_prefill() -> bool:
    """Whether the Triton path runs the prefill rows of a step in chunks (MOE_GATED_DELTA_PREFILL=chunked,
    the default) or token by token through the recurrent kernel, as decodes (=recurrent: the A/B
    baseline of the chunked kernel). Read once a process."""
    mode = os.environ.get("MOE_GATED_DELTA_PREFILL", "chunked")
    if mode not in PREFILL_MODES:
        raise ValueError(f"MOE_GATED_DELTA_PREFILL={mode!r}: expected one of {', '.join(PREFILL_MODES)}")
    return mode == "chunked"


def _positive_int(cfg: dict, key: str) -> int:
    value = hf_get(cfg, key)
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < 1:
        raise ValueError(f"field {key}={value!r} must be a positive integer")
    return int(value)


@dataclass
class Qwen3NextConfig(ModelConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    attention_bias: bool = False
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY_FACTOR
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Qwen3-Next's fused in_proj_qkvz / in_proj_ba (rows grouped per key head); False: Qwen3.5's
    # separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a.
    fused_linear_projections: bool = True
    nested_checkpoint: bool = False  # multimodal layout: text weights under model.language_model.

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "Qwen3NextConfig":
        nested = isinstance(cfg.get("text_config"), dict)
        if nested:
            cfg = {**{k: cfg[k] for k in _INHERITED_KEYS if k in cfg}, **cfg["text_config"]}
        qwen35 = architecture.startswith("Qwen3_5")
        if cfg.get("quantization_config") is not None:
            raise ValueError(f"quantization_config is not supported for {architecture} yet (only unquantised "
                             "checkpoints)")
        if "head_dim" not in cfg:  # transformers' default (256) is not hidden_size / num_attention_heads
            raise ValueError("config.json lacks the field 'head_dim'")
        if cfg.get("attn_output_gate") is False:
            raise ValueError("attn_output_gate=False is not supported: the full-attention layers' q_proj holds a "
                             "query and a gate per head (transformers' implementation)")
        common = cls.common_fields(cfg, architecture)
        n = common["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:
            interval = int(cfg.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
        types = list(types)
        unknown = sorted({str(t) for t in types if t not in LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types has unsupported layer type(s) {', '.join(map(repr, unknown))} "
                             f"(supported: {', '.join(LAYER_TYPES)})")
        if len(types) != n:
            raise ValueError(f"layer_types lists {len(types)} layers, but num_hidden_layers={n}")
        linear = {k: _positive_int(cfg, k) for k in _LINEAR_FIELDS} if "linear_attention" in types \
            else dict.fromkeys(_LINEAR_FIELDS, 0)
        if linear["linear_num_value_heads"] % max(linear["linear_num_key_heads"], 1):
            raise ValueError(f"linear_num_value_heads={linear['linear_num_value_heads']} must be a multiple of "
                             f"linear_num_key_heads={linear['linear_num_key_heads']}")
        # The hub's config.json has partial_rotary_factor at the top level, transformers 5 saves it
        # inside rope_parameters.
        factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
        factor = float(DEFAULT_PARTIAL_ROTARY_FACTOR if factor is None else factor)
        num_experts = int(hf_get(cfg, "num_experts"))
        if qwen35 and num_experts == 0:
            raise ValueError(f"{architecture} needs num_experts > 0 (every layer is an MoE layer)")
        moe = dict(num_experts=num_experts, num_experts_per_tok=0, moe_intermediate_size=0,
                   shared_expert_intermediate_size=0)
        if num_experts:
            moe.update({k: _positive_int(cfg, k) for k in ("num_experts_per_tok", "moe_intermediate_size",
                                                          "shared_expert_intermediate_size")})
        config = cls(
            **common, **linear, **moe,
            # Qwen3.5's router always renormalises and every layer is MoE (its config has no such fields).
            norm_topk_prob=True if qwen35 else bool(cfg.get("norm_topk_prob", True)),
            decoder_sparse_step=1 if qwen35 else int(cfg.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=[] if qwen35 else [int(i) for i in cfg.get("mlp_only_layers") or []],
            attention_bias=bool(cfg.get("attention_bias", False)),
            partial_rotary_factor=factor,
            layer_types=types,
            fused_linear_projections=not qwen35,
            nested_checkpoint=nested,
        )
        rot = config.rotary_dim
        if not 0 < rot <= config.head_dim or rot % 2:
            raise ValueError(f"partial_rotary_factor={factor} gives {rot} rotary dims of head_dim={config.head_dim}: "
                             "they must be even and between 2 and head_dim")
        check_moe_fields("num_experts", config.num_experts, config.num_experts_per_tok)
        dense = [i for i in range(n) if not config.is_moe_layer(i)]
        if dense and config.intermediate_size <= 0:
            raise ValueError(f"layers {dense} are dense MLP layers but config.json has no positive "
                             f"intermediate_size (got {config.intermediate_size})")
        return config

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)  # truncated, as transformers does

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight w is stored centred on zero: out = norm(x_fp32) * (1 + w_fp32),
    cast to x's dtype (the product is taken in fp32, unlike RMSNorm's weight * norm(x).to(dtype)).
    Same call as RMSNorm (with `residual`: (norm(x + residual), x + residual)); torch maths on every
    device (the fused kernels take the weight as a plain scale)."""

    def forward(self, x: torch.Tensor | TopKSum, residual: torch.Tensor | None = None):
        if isinstance(x, TopKSum):
            x = x.materialize()
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)


class GatedQKVParallelLinear(QKVParallelLinear):
    """Fused q, k, v projections whose q_proj [2 * H * d, D] holds per head its query rows then its gate
    rows: each rank takes its heads' 2 * d rows (a contiguous block), then k and v as QKVParallelLinear
    (the KV heads split or replicated). Output [T, 2 * q_size + 2 * kv_size]: this rank's heads'
    [query | gate] pairs, then k, then v."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size, head_dim, num_heads, num_kv_heads, bias)
        ps, kv = get_parallel_state(), self.weight.param_loader.shards
        qg = 2 * self.q_size
        shards = {"q": Shard(2 * num_heads * head_dim, ps.tp_rank * qg, qg, 0),
                  "k": Shard(kv["k"].full, kv["k"].ckpt_start, self.kv_size, qg),
                  "v": Shard(kv["v"].full, kv["v"].ckpt_start, self.kv_size, qg + self.kv_size)}
        self._init_params(hidden_size, qg + 2 * self.kv_size, shards, bias)


class Qwen3NextAttention(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = GatedQKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                               bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        # Qwen3.5's multimodal RoPE is this 1-D one for text (module docstring).
        self.rotary_emb = get_rope(d, cfg.rope_max_position, cfg.rope, rotary_dim=cfg.rotary_dim)
        self.attn = Attention(self.qkv_proj.num_heads, d, self.qkv_proj.num_kv_heads, d ** -0.5)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d, p = x.shape[0], self.head_dim, self.qkv_proj
        qg, k, v = p(x).split([2 * p.q_size, p.kv_size, p.kv_size], -1)
        q, gate = qg.view(T, p.num_heads, 2 * d).split([d, d], -1)
        q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k.reshape(T, p.num_kv_heads, d)))
        out = self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(T, -1)))


class RowSegmentsLoader(ParamLoader):
    """Checkpoint tensors whose rows land in this rank's parameter as segments. `pieces`: per shard id,
    (the checkpoint tensor's row count, [(checkpoint row, rows, parameter row), ...]). The checkpoint
    tensor's trailing dims are `ckpt_tail` (default the parameter's); it is viewed as the parameter's
    trailing dims (conv1d.weight [C, 1, K] into [C_local, K])."""

    def __init__(self, param_shape: tuple[int, ...], pieces: dict, ckpt_tail: tuple[int, ...] | None = None) -> None:
        self.param_shape, self.segments = tuple(param_shape), pieces
        self.tail = tuple(ckpt_tail) if ckpt_tail is not None else self.param_shape[1:]

    def pieces(self):
        return [(s, None) for s in self.segments]

    def ckpt_shape(self, shard_id, expert_id):
        return (self.segments[shard_id][0], *self.tail)

    def load(self, param, tensor, shard_id, expert_id):
        rows = tensor.reshape(tensor.shape[0], *param.shape[1:])
        for src, size, dst in self.segments[shard_id][1]:
            param.data[dst:dst + size].copy_(rows[src:src + size])
        return [(shard_id, None)]


class CausalConv1dWeight(nn.Module):
    """The depthwise conv's weight [channels, K] (the checkpoint's conv1d.weight [C, 1, K], this rank's
    channels); the conv itself is kernels.gated_delta.causal_conv1d_varlen."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class GatedRMSNorm(nn.Module):
    """weight * norm(x), times silu(z), over the last dim (the weight is a plain scale, initialised to
    ones: not zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = attach_loader(new_param(dim), ReplicatedLoader((dim,)))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, z, self.weight, self.eps)


class Qwen3NextGatedDeltaNet(nn.Module):
    """The linear-attention token mixer of one layer: x [T, D] -> [T, D], its recurrent state carried
    per sequence in the pools `conv_state` [N, C, K - 1] and `ssm_state` [N, Hv, Dk, Dv] (set by the
    model runner from `state_shapes`; C = 2 Hk Dk + Hv Dv channels, all of this rank's heads)."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        ps = get_parallel_state()
        tp, r = ps.tp_size, ps.tp_rank
        Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        for name, heads in (("linear_num_key_heads", Hk), ("linear_num_value_heads", Hv)):
            if heads % tp:
                raise ValueError(f"{name}={heads} is not divisible by tensor_parallel_size={tp} (each rank holds "
                                 "whole Gated DeltaNet heads)")
        Kl, Vl, ratio = Hk // tp, Hv // tp, Hv // Hk
        self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim = Kl, Vl, dk, dv
        self.kernel_size = K
        # This rank's projection rows: q | k | v | z | b | a, each in head order.
        sizes = [Kl * dk, Kl * dk, Vl * dv, Vl * dv, Vl, Vl]
        q0, k0, v0, z0, b0, a0 = (sum(sizes[:i]) for i in range(6))
        self.conv_dim, self.split_sizes = 2 * Kl * dk + Vl * dv, [2 * Kl * dk + Vl * dv, Vl * dv, Vl, Vl]
        key_dim, value_dim = Hk * dk, Hv * dv
        # Checkpoint rows of this rank's q, k, v channels in plain order (Qwen3.5's in_proj_qkv, and the
        # conv weight of both families).
        qkv = [(r * Kl * dk, Kl * dk, q0), (key_dim + r * Kl * dk, Kl * dk, k0),
               (2 * key_dim + r * Vl * dv, Vl * dv, v0)]
        if cfg.fused_linear_projections:  # rows grouped per key head h: q_h, k_h, v and z of its value heads
            gs, heads = 2 * dk + 2 * ratio * dv, range(r * Kl, (r + 1) * Kl)
            qkvz = [seg for i, h in enumerate(heads) for seg in (
                (h * gs, dk, q0 + i * dk), (h * gs + dk, dk, k0 + i * dk),
                (h * gs + 2 * dk, ratio * dv, v0 + i * ratio * dv),
                (h * gs + 2 * dk + ratio * dv, ratio * dv, z0 + i * ratio * dv))]
            ba = [seg for i, h in enumerate(heads) for seg in (
                (h * 2 * ratio, ratio, b0 + i * ratio), (h * 2 * ratio + ratio, ratio, a0 + i * ratio))]
            pieces = {"qkvz": (2 * key_dim + 2 * value_dim, qkvz), "ba": (2 * Hv, ba)}
        else:
            pieces = {"qkv": (2 * key_dim + value_dim, qkv), "z": (value_dim, [(r * Vl * dv, Vl * dv, z0)]),
                      "b": (Hv, [(r * Vl, Vl, b0)]), "a": (Hv, [(r * Vl, Vl, a0)])}
        self.in_proj = ReplicatedLinear(cfg.hidden_size, sum(sizes))
        attach_loader(self.in_proj.weight, RowSegmentsLoader((sum(sizes), cfg.hidden_size), pieces))
        # the conv's channels: this rank's q | k | v, as the projection's first rows
        conv = RowSegmentsLoader((self.conv_dim, K), {None: (2 * key_dim + value_dim, qkv)}, ckpt_tail=(1, K))
        self.conv1d = CausalConv1dWeight(attach_loader(new_param(self.conv_dim, K), conv))
        heads_v = {None: (Hv, [(r * Vl, Vl, 0)])}
        self.A_log = attach_loader(new_param(Vl), RowSegmentsLoader((Vl,), heads_v))
        self.dt_bias = attach_loader(new_param(Vl), RowSegmentsLoader((Vl,), heads_v))
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, cfg.hidden_size)
        self.conv_state: torch.Tensor | None = None  # [N, C, K - 1], bound by the model runner
        self.ssm_state: torch.Tensor | None = None  # [N, Hv, Dk, Dv] fp32, bound by the model runner

    def state_shapes(self, num_slots: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The state pools this layer needs for num_slots sequences: attribute -> (shape, dtype)."""
        return {"conv_state": ((num_slots, self.conv_dim, self.kernel_size - 1), self.conv1d.weight.dtype),
                "ssm_state": ((num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)}

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("linear attention ran before the model runner bound its state pools")
        slots, has_initial = getattr(meta, "state_slots_B", None), getattr(meta, "has_initial_state_B", None)
        if slots is None or has_initial is None:
            raise RuntimeError("linear attention needs the step's state slots (AttentionMetadata.state_slots_B "
                               "and has_initial_state_B)")
        T, qsl = x.shape[0], meta.query_start_loc
        Kl, Vl, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        chunked = False
        if use_triton_attention(x):  # the Triton kernels, reading the layout on the device where it is there
            # steps with prefill tokens: their longer sequences in chunks (tensor-core products), the
            # decodes token by token as in decode-only steps (kernels/triton_gated_delta_chunked.py)
            conv = causal_conv1d_varlen_triton
            delta = gated_delta_rule_recurrent_triton if meta.decode_only or not chunked_prefill() \
                else gated_delta_rule_chunked_triton
            if meta.query_start_loc_t is not None:
                qsl = meta.query_start_loc_t
                # a step with prefill tokens, eagerly: fla-core's chunked kernel where installed
                chunked = not meta.decode_only and fla_prefill_available() \
                    and not torch.cuda.is_current_stream_capturing()
        else:
            conv, delta = causal_conv1d_varlen, gated_delta_rule_varlen
        mixed, z, b, a = self.in_proj(x).split(self.split_sizes, -1)
        mixed = conv(mixed, self.conv1d.weight, None, qsl, self.conv_state, slots, has_initial, activation="silu")
        q, k, v = mixed.split([Kl * dk, Kl * dk, Vl * dv], -1)
        beta = torch.sigmoid(b)
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        if chunked:  # the step's split into decode and prefill rows, made by its first linear layer
            split = meta.derived.get("gated_delta_split")
            if split is None:
                split = meta.derived["gated_delta_split"] = PrefillSplit(meta.query_start_loc, slots, has_initial)
            o = gated_delta_rule_prefill_split(q.view(T, Kl, dk), k.view(T, Kl, dk), v.view(T, Vl, dv), g, beta,
                                               split, self.ssm_state, gated_delta_rule_recurrent_triton,
                                               scale=dk ** -0.5, use_qk_l2norm=True)
        else:
            o = delta(q.view(T, Kl, dk), k.view(T, Kl, dk), v.view(T, Vl, dv), g, beta, qsl, self.ssm_state, slots,
                      has_initial, scale=dk ** -0.5, use_qk_l2norm=True)
        o = self.norm(o, z.view(T, Vl, dv))
        return self.out_proj(o.reshape(T, Vl * dv))


class GatedSharedExpert(SwiGLUMLP):
    """The shared expert: sigmoid(expert_gate(x)) * SwiGLU(x), expert_gate a Linear(D, 1)
    (checkpoint: mlp.shared_expert.* and mlp.shared_expert_gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.expert_gate = ReplicatedLinear(hidden_size, 1)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.expert_gate(x_TD)) * super().forward(x_TD)


class Qwen3NextDecoderLayer(PreNormDecoderLayer):
    """The token mixer is `self_attn` (full attention) or `linear_attn` (Gated DeltaNet), as the
    checkpoint names them."""

    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int, moe_parallel: MoEParallelConfig) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == "full_attention":
            self.self_attn = Qwen3NextAttention(cfg)
        else:
            self.linear_attn = Qwen3NextGatedDeltaNet(cfg)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoEBlock(
                gate=ReplicatedLinear(cfg.hidden_size, cfg.num_experts),
                router_fn=functools.partial(softmax_topk, top_k=cfg.num_experts_per_tok,
                                            renormalize=cfg.norm_topk_prob),
                experts=FusedMoE(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, moe_parallel),
                shared_experts=GatedSharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size),
            )
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.layer_type == "full_attention":
            x = self.self_attn(positions, x, meta)
        else:
            x = self.linear_attn(x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3NextModel(DecoderStack):
    def __init__(self, cfg: Qwen3NextConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: Qwen3NextDecoderLayer(cfg, i, moe_parallel))
        if last_stage():
            self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _MultimodalModel(nn.Module):
    """`model.` of a multimodal checkpoint: the text model as `language_model` (the vision tower
    `visual` is not loaded)."""

    def __init__(self, language_model: Qwen3NextModel) -> None:
        super().__init__()
        self.language_model = language_model
        self.make_empty_intermediate_tensors = language_model.make_empty_intermediate_tensors

    @property
    def embed_tokens(self) -> nn.Module:
        return self.language_model.embed_tokens

    def stage_layers(self) -> list[nn.Module]:
        return self.language_model.stage_layers()

    def forward(self, *args, **kwargs):
        return self.language_model(*args, **kwargs)


class Qwen3NextForCausalLM(DecoderForCausalLM):
    """Qwen3-Next and Qwen3.5-MoE (text). Built from a multimodal config (text_config) the text model
    sits under `model.language_model`, as in that checkpoint."""
    config_class = Qwen3NextConfig

    def __init__(self, cfg: Qwen3NextConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        stack = Qwen3NextModel(cfg, moe_parallel)
        super().__init__(cfg, _MultimodalModel(stack) if cfg.nested_checkpoint else stack)
        self._logged_skip = False

    @property
    def _text_model(self) -> Qwen3NextModel:
        return self.model.language_model if self.config.nested_checkpoint else self.model

    @property
    def _embed_name(self) -> str:
        return "model.language_model.embed_tokens" if self.config.nested_checkpoint else "model.embed_tokens"

    def attention_layers(self) -> list[nn.Module]:
        """This pipeline stage's full-attention layers' Attention modules (their KV caches)."""
        return [layer.self_attn.attn for layer in self._text_model.stage_layers()
                if layer.layer_type == "full_attention"]

    def recurrent_layers(self) -> list[nn.Module]:
        """This pipeline stage's Gated DeltaNet modules, in layer order (their state pools)."""
        return [layer.linear_attn for layer in self._text_model.stage_layers()
                if layer.layer_type == "linear_attention"]

    def weight_name_rules(self) -> list[NameRule]:
        # First match wins: the shared-expert rules precede the generic gate/up/down ones.
        if self.config.fused_linear_projections:
            in_proj = [NameRule("linear_attn.in_proj", f"linear_attn.in_proj_{s}", s) for s in ("qkvz", "ba")]
        else:
            in_proj = [NameRule("linear_attn.in_proj", f"linear_attn.in_proj_{s}", s) for s in ("qkv", "z", "b", "a")]
        return tied_lm_head_rules(self.config.tie_word_embeddings, self._embed_name) + [
            NameRule("shared_experts.gate_up_proj", "shared_expert.gate_proj", 0),
            NameRule("shared_experts.gate_up_proj", "shared_expert.up_proj", 1),
            NameRule("shared_experts.down_proj", "shared_expert.down_proj"),
            NameRule("shared_experts.expert_gate", "shared_expert_gate"),
        ] + in_proj + EXPERT_RULES + QKV_RULES + GATE_UP_RULES

    def ignore_checkpoint_name(self, name: str) -> bool:
        if name.startswith(_SKIPPED_PREFIXES):
            if not self._logged_skip:
                logger.info("Skipping the multi-token-prediction (mtp.*) and vision (model.visual.*) tensors of the "
                            "%s checkpoint: only the text model is loaded", self.config.architecture)
                self._logged_skip = True
            return True
        tied = self.config.tie_word_embeddings
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            return True
        return skip_other_stage_tensor(name, self, tied, self._embed_name)
