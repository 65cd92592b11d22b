"""gpt-oss (`GptOssForCausalLM`, openai/gpt-oss-20b and -120b): GQA attention with q/k/v/o biases and a
learned sink logit per head, alternating sliding-window (`sliding_window`, 128) and full layers as
`layer_types` says, YaRN NeoX RoPE; in every layer an MoE block whose router has a bias (softmax over
the top-k logits) and whose experts have biases and the clamped SwiGLU ("swigluoai": `swiglu_alpha`,
`swiglu_limit`).

Checkpoint layouts, both loaded: transformers' (`mlp.experts.gate_up_proj` [E, D, 2F] with gate and up
interleaved along the last dim, `down_proj` [E, F, D], biases `gate_up_proj_bias` [E, 2F] interleaved and
`down_proj_bias` [E, D]) and the hub's MXFP4 one (`gate_up_proj_blocks` [E, 2F, D/32, 16] +
`gate_up_proj_scales` [E, 2F, D/32], `down_proj_blocks` [E, D, F/32, 16] + `down_proj_scales`, same
biases; config.json `quantization_config.quant_method: mxfp4`). MXFP4 experts stay MXFP4 where the
engine decides so (`keep_mxfp4`, models/mxfp4.py resolve_mxfp4_experts: on CUDA with the Triton
kernel), else they are dequantised at load to the model dtype. The router is `mlp.router` on disk,
`mlp.gate` here.

Sliding-window layers form a KV-cache group of their own that releases the blocks behind the
window, unless prefix caching is on: they then share the full-attention group (which keeps the prefix).
"""
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
from models.layers.moe import ExpertActivation, ExpertWeightLoader, FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.layers.weights import ParamLoader, Shard, ShardedLoader, attach_loader, new_param
from models.loader import QKV_RULES, NameRule
from models.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4
from models.parallel.pipeline import tied_lm_head_rules
from models.parallel.state import get_parallel_state
from routing import softmax_topk
from scheduler.kv_cache_spec import SlidingWindow

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssConfig(ModelConfig):
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    mxfp4: bool = False  # the hub's experts: MXFP4 blocks and scales
    keep_mxfp4: bool = False  # serve them as MXFP4 (set by the engine for the device)

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "GptOssConfig":
        layers = int(hf_get(cfg, "num_hidden_layers"))
        types = list(cfg.get("layer_types") or
                     ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
        if len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types must list {layers} entries of {', '.join(LAYER_TYPES)}, got {types}")
        window = cfg.get("sliding_window")
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ValueError(f"sliding_window={window!r} must be a positive integer for sliding_attention layers")
        qc = cfg.get("quantization_config")
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if qc is not None and method != "mxfp4":
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported for gpt-oss "
                             "(only 'mxfp4', the hub's experts)")
        config = cls(**cls.common_fields(cfg, architecture),
                     num_local_experts=int(hf_get(cfg, "num_local_experts", "num_experts")),
                     num_experts_per_tok=int(hf_get(cfg, "num_experts_per_tok")),
                     sliding_window=int(window) if window else None, layer_types=types,
                     swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                     attention_bias=bool(cfg.get("attention_bias", True)), mxfp4=method == "mxfp4")
        check_moe_fields("num_local_experts", config.num_local_experts, config.num_experts_per_tok)
        if config.mxfp4 and (config.hidden_size % MXFP4_BLOCK or config.intermediate_size % MXFP4_BLOCK):
            raise ValueError(f"MXFP4 experts need hidden_size ({config.hidden_size}) and intermediate_size "
                             f"({config.intermediate_size}) to be multiples of {MXFP4_BLOCK}")
        return config


    def kv_cache_keys(self) -> list:
        return [SlidingWindow(self.sliding_window) if t == "sliding_attention" else None for t in self.layer_types]


class GptOssAttention(nn.Module):
    def __init__(self, cfg: GptOssConfig, layer_idx: int) -> None:
        super().__init__()
        d, H = cfg.head_dim, cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, H, cfg.num_key_value_heads, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(H * d, cfg.hidden_size, bias=cfg.attention_bias)
        self.rotary_emb = get_rope(d, cfg.rope_max_position, cfg.rope)
        Hl, rank = self.qkv_proj.num_heads, get_parallel_state().tp_rank
        sinks = attach_loader(new_param(Hl, dtype=torch.float32),
                              ShardedLoader((Hl,), 0, {None: Shard(H, rank * Hl, Hl, 0)}))
        window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding_attention" else None
        self.attn = Attention(Hl, d, self.qkv_proj.num_kv_heads, d ** -0.5, sliding_window=window, sinks=sinks)
        self.head_dim = d

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q, k = self.rotary_emb(positions, q.reshape(T, -1, d), k.reshape(T, -1, d))
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta))


class InterleavedExpertLoader(ParamLoader):
    """gpt-oss's expert tensors into FusedMoE's layout (w13 [E, 2F, D] gate rows then up rows, w2
    [E, D, F], biases [E, 2F] / [E, D]). On disk gate and up alternate (even = gate, odd = up); the
    dense weights are transposed ([E, D, 2F], [E, F, D]); MXFP4 weights come as `blocks` + `scales`
    along the input dim: dequantised once both have arrived, or, into uint8 parameters (MXFP4 kept),
    copied as they are (`what` "w13_scale" / "w2_scale" for the scales). One piece a parameter: "dense"."""

    def __init__(self, experts: ExpertWeightLoader, what: str) -> None:
        self.w, self.what = experts, what  # what: "w13", "w2", "w13_bias", "w2_bias", "w13_scale", "w2_scale"
        self.packed: dict[str, torch.Tensor] = {}

    def pieces(self):
        return [("dense", None)]

    def stored_dtype(self, shard_id):
        return torch.uint8 if shard_id in ("blocks", "scales") else None

    def ckpt_shape(self, shard_id, expert_id):
        E, D, F = self.w.E, self.w.D, self.w.F
        rows, cols = {"w13": (2 * F, D), "w2": (D, F), "w13_bias": (2 * F, None), "w2_bias": (D, None),
                      "w13_scale": (2 * F, D), "w2_scale": (D, F)}[self.what]
        if shard_id == "blocks":
            return (E, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2)
        if shard_id == "scales":
            return (E, rows, cols // MXFP4_BLOCK)
        return (E, rows) if cols is None else (E, cols, rows)

    def load(self, param, tensor, shard_id, expert_id):
        per = 1  # input columns a stored element holds (an F slice of down's columns is f0 / per ..)
        if param.dtype == torch.uint8 and shard_id == "dense":
            raise ValueError("config.json says the experts are MXFP4 (quantization_config), but the checkpoint "
                             "holds them dense (gate_up_proj / down_proj without _blocks / _scales)")
        if param.dtype == torch.uint8:  # MXFP4 kept: blocks [E, out, in/32, 16] as [E, out, in/2], scales
            rows, per = (tensor.flatten(2), 2) if shard_id == "blocks" else (tensor, MXFP4_BLOCK)
        elif shard_id in ("blocks", "scales"):
            self.packed[shard_id] = tensor
            if len(self.packed) < 2:
                return []
            rows = dequantize_mxfp4(self.packed.pop("blocks"), self.packed.pop("scales"), param.dtype)
        else:
            rows = tensor if self.what.endswith("bias") else tensor.transpose(1, 2)  # [E, out, in]
        f0, Fl = self.w.f0 // per, self.w.Fl // per
        for g, slots in self.w.local_of.items():
            for local in slots:
                if self.what.startswith("w13"):  # this rank's F slice of gate (even rows) and of up (odd)
                    f0, Fl = self.w.f0, self.w.Fl  # rows: output features, never packed
                    param.data[local, :Fl].copy_(rows[g, 0::2][f0:f0 + Fl])
                    param.data[local, Fl:].copy_(rows[g, 1::2][f0:f0 + Fl])
                elif self.what in ("w2", "w2_scale"):
                    param.data[local].copy_(rows[g][:, f0:f0 + Fl])
                else:
                    param.data[local].copy_(rows[g])
        return [("dense", None)]


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: GptOssConfig, layer_idx: int, moe_parallel: MoEParallelConfig) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(cfg, layer_idx)
        act = ExpertActivation("swigluoai", bias=True, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
        experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, moe_parallel,
                           top_k=cfg.num_experts_per_tok, activation=act, mxfp4=cfg.keep_mxfp4)
        bases = {"w13": experts.w13_weight.param_loader, "w2": experts.w2_weight.param_loader}
        names = ("w13_weight", "w2_weight", "w13_bias", "w2_bias") + \
            (("w13_weight_scale", "w2_weight_scale") if cfg.keep_mxfp4 else ())
        for name in names:
            attach_loader(getattr(experts, name), InterleavedExpertLoader(bases[name.split("_")[0]],
                                                                          name.replace("_weight", "")))
        # softmax over all experts, then the top-k renormalised = softmax over the top-k logits
        self.mlp = MoEBlock(
            gate=ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts, bias=True),
            router_fn=functools.partial(softmax_topk, top_k=cfg.num_experts_per_tok, renormalize=True),
            experts=experts,
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssModel(DecoderStack):
    def __init__(self, cfg: GptOssConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: GptOssDecoderLayer(cfg, i, moe_parallel))


class GptOssForCausalLM(DecoderForCausalLM):
    config_class = GptOssConfig

    def __init__(self, cfg: GptOssConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__(cfg, GptOssModel(cfg, moe_parallel))

    def weight_name_rules(self) -> list[NameRule]:
        kept = self.config.keep_mxfp4  # the scales then fill parameters of their own
        experts = [NameRule(f"experts.{param}{'_scale' if kept and shard == 'scales' else ''}",
                            f"experts.{ckpt}{suffix}", shard)
                   for param, ckpt in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj"))
                   for suffix, shard in (("_blocks", "blocks"), ("_scales", "scales"), ("", "dense"))]
        return tied_lm_head_rules(self.config.tie_word_embeddings) + experts + [
            NameRule("experts.w13_bias", "experts.gate_up_proj_bias", "dense"),
            NameRule("experts.w2_bias", "experts.down_proj_bias", "dense"),
            NameRule("mlp.gate", "mlp.router"),
            NameRule("self_attn.attn.sinks", "self_attn.sinks"),
        ] + QKV_RULES
