"""Llama-4 text (`Llama4ForCausalLM`, and the text half of `Llama4ForConditionalGeneration`).

What differs from Qwen3-MoE:
- attention: RoPE layers (`no_rope_layers[i] == 1`) rotate q/k in the interleaved (complex
  pair) layout, L2-normalise them after RoPE (weightless, `use_qk_norm`) and attend chunked-
  locally (`attention_chunk_size`); NoPE layers (0) attend globally and scale their queries by
  the attention temperature log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1.
- MoE: top-k (top-1 in released models) over raw router logits; the sigmoid score scales the
  expert's *input*; one shared expert always runs. `moe_layers` (or every
  `interleave_moe_layer_step`-th layer) are MoE, the rest dense SwiGLU of `intermediate_size_mlp`.
- hub layout: fused 3-D experts `experts.gate_up_proj [E, D, 2F]` / `experts.down_proj [E, F, D]`
  (transposed relative to our w13 [E, 2F, D] / w2 [E, D, F]); multimodal checkpoints nest the
  text model under `language_model.` and its config under `text_config`.
- vision: the tower (models/llama4_vision.py) is built and loaded only when `config.load_vision`
  is set (by the engine, before the model is built); otherwise its tensors are skipped.

Legend: T tokens, D hidden, E experts, F expert intermediate size, K top-k.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.attention import AttentionMetadata
from models.config import ModelConfig, check_moe_fields, hf_get
from models.layers.attention import Attention
from models.layers.decoder import DecoderStack, PreNormDecoderLayer, make_lm_head
from models.layers.embedding import ParallelLMHead
from models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from models.layers.mlp import SwiGLUMLP
from models.layers.moe import ExpertWeightLoader, FusedMoE, MoEBlock, MoEParallelConfig
from models.layers.norm import RMSNorm
from models.layers.rotary import get_rope
from models.llama4_vision import (
    VISION_CHECKPOINT_PREFIXES,
    Llama4VisionConfig,
    Llama4VisionEncoder,
    merge_image_features,
)
from models.loader import GATE_UP_RULES, QKV_RULES, NameRule
from models.parallel.pipeline import IntermediateTensors, first_stage, skip_other_stage_tensor, tied_lm_head_rules
from routing.llama4_router import llama4_topk

logger = logging.getLogger("moe.models.llama4")

_DEFAULT_ROPE_THETA = 500000.0  # transformers' Llama4TextConfig.default_theta
# Top-level keys of a multimodal config.json that the text model inherits when text_config lacks them.
_INHERITED_KEYS = ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings")


@dataclass
class Llama4TextConfig(ModelConfig):
    num_local_experts: int = 0
    num_experts_per_tok: int = 1
    intermediate_size_mlp: int = 0           # dense layers; `intermediate_size` is the experts'
    moe_layers: list[int] = field(default_factory=list)
    no_rope_layers: list[int] = field(default_factory=list)   # per layer: 1 = RoPE, 0 = NoPE
    layer_types: list[str] = field(default_factory=list)      # "chunked_attention" | "full_attention"
    use_qk_norm: bool = True
    attention_chunk_size: int | None = None
    attn_temperature_tuning: bool = True
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    attention_bias: bool = False
    nested_checkpoint: bool = False          # weights under `language_model.` (multimodal checkpoint)
    vision: Llama4VisionConfig | None = None  # the checkpoint's vision tower, if it has one
    vision_error: str | None = None          # why `vision_config` could not be parsed (raised only if used)
    load_vision: bool = False                # build + load the vision tower (else its tensors are skipped)

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "Llama4TextConfig":
        nested = isinstance(cfg.get("text_config"), dict)
        vision, vision_error = None, None
        if isinstance(cfg.get("vision_config"), dict):
            try:  # a text-only load must not fail on the vision part
                vision = Llama4VisionConfig.from_hf(cfg)
            except (ValueError, TypeError) as e:
                vision_error = str(e)
        if nested:
            cfg = {**{k: cfg[k] for k in _INHERITED_KEYS if k in cfg}, **cfg["text_config"]}
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg = {**cfg, "rope_theta": _DEFAULT_ROPE_THETA}
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Llama-4 with hidden_act={act!r} is not supported (only 'silu')")
        common = cls.common_fields(cfg, architecture)
        if common["rope"].scaling_type == "llama3" and common["rope"].original_max_position_embeddings is None:
            common["rope"].original_max_position_embeddings = common["max_position_embeddings"]
        n = common["num_hidden_layers"]
        # transformers: an empty or absent list means "every no_rope_layer_interval-th layer is NoPE".
        interval = int(cfg.get("no_rope_layer_interval", 4) or 4)
        no_rope = [int(v) for v in cfg.get("no_rope_layers") or []] or \
            [int((i + 1) % interval != 0) for i in range(n)]
        if len(no_rope) < n:
            raise ValueError(f"no_rope_layers has {len(no_rope)} entries for {n} layers")
        chunk = cfg.get("attention_chunk_size")
        chunk = int(chunk) if chunk else None
        layer_types = list(cfg.get("layer_types") or
                           ["chunked_attention" if r and chunk is not None else "full_attention" for r in no_rope])
        if chunk is None and "chunked_attention" in layer_types:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is not set")
        moe_layers = cfg.get("moe_layers")
        if moe_layers is None:
            step = int(cfg.get("interleave_moe_layer_step", 1) or 1)
            moe_layers = list(range(step - 1, n, step))
        config = cls(
            **common,
            num_local_experts=int(hf_get(cfg, "num_local_experts", "num_experts")),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 1) or 1),
            intermediate_size_mlp=int(hf_get(cfg, "intermediate_size_mlp")),
            moe_layers=[int(i) for i in moe_layers],
            no_rope_layers=no_rope[:n],
            layer_types=layer_types[:n],
            use_qk_norm=bool(cfg.get("use_qk_norm", True)),
            attention_chunk_size=chunk,
            # Hub configs write `"attn_temperature_tuning": 4`; transformers only tests its truth.
            attn_temperature_tuning=bool(cfg.get("attn_temperature_tuning", True)),
            floor_scale=float(cfg.get("floor_scale", 8192)),
            attn_scale=float(cfg.get("attn_scale", 0.1)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            nested_checkpoint=nested,
            vision=vision,
            vision_error=vision_error,
        )
        check_moe_fields("num_local_experts", config.num_local_experts, config.num_experts_per_tok)
        return config

    def uses_rope(self, layer_idx: int) -> bool:
        return bool(self.no_rope_layers[layer_idx])

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.moe_layers and self.num_local_experts > 0


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS normalisation over the last dim, in fp32 (transformers' Llama4TextL2Norm)."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class HubExpertWeightLoader(ExpertWeightLoader):
    """Llama-4's fused hub tensors are transposed relative to ours: gate_up_proj [E, D, 2F]
    (gate columns then up columns), down_proj [E, F, D]. Transpose, then load as w13 / w2."""

    @classmethod
    def replacing(cls, param: torch.nn.Parameter) -> None:
        loader = object.__new__(cls)
        loader.__dict__.update(param.param_loader.__dict__)
        param.param_loader = loader

    def ckpt_shape(self, shard_id, expert_id):
        shape = super().ckpt_shape(shard_id, expert_id)
        return shape if expert_id is not None else (shape[0], shape[2], shape[1])

    def load(self, param, tensor, shard_id, expert_id):
        return super().load(param, tensor if expert_id is not None else tensor.transpose(1, 2), shard_id, expert_id)


class Llama4Attention(nn.Module):
    def __init__(self, cfg: Llama4TextConfig, layer_idx: int, rotary_emb: nn.Module | None) -> None:
        super().__init__()
        d = cfg.head_dim
        self.head_dim, self.eps = d, cfg.rms_norm_eps
        self.use_rope = cfg.uses_rope(layer_idx)
        self.qk_norm = cfg.use_qk_norm and self.use_rope
        self.temperature_tuning = cfg.attn_temperature_tuning and not self.use_rope
        self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads,
                                          bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.attention_bias)
        # One table shared by every RoPE layer, as long as max_model_len.
        self.rotary_emb = rotary_emb if self.use_rope else None
        chunk = cfg.attention_chunk_size if cfg.layer_types[layer_idx] == "chunked_attention" else None
        self.attn = Attention(self.qkv_proj.num_heads, d, self.qkv_proj.num_kv_heads, d ** -0.5, chunk_size=chunk)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], -1)
        q, k = q.reshape(T, -1, d), k.reshape(T, -1, d)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        if self.qk_norm:  # after RoPE, as transformers does
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature_tuning:  # by absolute position, so cached context does not change it
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q.reshape(T, -1), k.reshape(T, -1), v, meta))


class Llama4DecoderLayer(PreNormDecoderLayer):
    ffn_name = "feed_forward"  # the checkpoint's name

    def __init__(self, cfg: Llama4TextConfig, layer_idx: int, rotary_emb: nn.Module,
                 moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__()
        self.self_attn = Llama4Attention(cfg, layer_idx, rotary_emb)
        if cfg.is_moe_layer(layer_idx):
            self.feed_forward = MoEBlock(
                gate=ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts),
                router_fn=functools.partial(llama4_topk, top_k=cfg.num_experts_per_tok),
                experts=FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, moe_parallel),
                shared_experts=SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size),
                apply_router_weight_on_input=True,  # expert_e(sigmoid(l_e) * x)
            )
            HubExpertWeightLoader.replacing(self.feed_forward.experts.w13_weight)
            HubExpertWeightLoader.replacing(self.feed_forward.experts.w2_weight)
        else:
            self.feed_forward = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size_mlp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

class Llama4TextModel(DecoderStack):
    def __init__(self, cfg: Llama4TextConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        moe_parallel = moe_parallel or MoEParallelConfig.from_parallel_state()
        # One RoPE table for every RoPE layer. Interleaved (complex-pair) RoPE, as transformers'
        # apply_rotary_emb (view_as_complex).
        rotary = get_rope(cfg.head_dim, cfg.rope_max_position, cfg.rope, is_neox_style=False) \
            if any(cfg.uses_rope(i) for i in range(cfg.num_hidden_layers)) else None
        super().__init__(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps,
                         lambda i: Llama4DecoderLayer(cfg, i, rotary, moe_parallel))


class _LanguageModel(nn.Module):
    """`language_model.` of a multimodal checkpoint: the text model and its lm_head."""

    def __init__(self, model: Llama4TextModel, lm_head: ParallelLMHead) -> None:
        super().__init__()
        self.model, self.lm_head = model, lm_head


class Llama4ForCausalLM(nn.Module):
    """Llama-4 text model. Built from a `Llama4ForConditionalGeneration` checkpoint it holds its
    modules under `language_model` so that parameter names match the nested checkpoint names;
    the vision tower's tensors are skipped unless `config.load_vision` (then `vision_encoder`
    holds the tower, on the first pipeline stage, and `embed_with_images` merges its features)."""
    config_class = Llama4TextConfig
    supports_pp = True  # builds only its pipeline stage (models/parallel/pipeline.py)

    def __init__(self, cfg: Llama4TextConfig, moe_parallel: MoEParallelConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        model = Llama4TextModel(cfg, moe_parallel)
        lm_head = make_lm_head(cfg.vocab_size, cfg.hidden_size, cfg.tie_word_embeddings, model)
        if cfg.nested_checkpoint:
            self.language_model = _LanguageModel(model, lm_head)
        else:
            self.model, self.lm_head = model, lm_head
        self.make_empty_intermediate_tensors = model.make_empty_intermediate_tensors
        self._prefix = "language_model." if cfg.nested_checkpoint else ""
        self._logged_vision_skip = False
        self.vision_encoder = None
        if cfg.load_vision:
            if cfg.vision is None:
                raise ValueError(f"load_vision is set but the {cfg.architecture} checkpoint has no usable "
                                 f"vision_config{': ' + cfg.vision_error if cfg.vision_error else ''}")
            if first_stage():  # images are embedded where the token embeddings are
                self.vision_encoder = Llama4VisionEncoder(cfg.vision)

    @property
    def _lm(self) -> nn.Module:
        return self.language_model if self.config.nested_checkpoint else self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate_tensors: IntermediateTensors | None = None, inputs_embeds: torch.Tensor | None = None):
        """input_ids, positions [T] -> final hidden states [T, D] (last pipeline stage), or this
        stage's IntermediateTensors for the next one. inputs_embeds [T, D] (first stage): the
        embeddings to use instead of the ids' (with image features merged in)."""
        return self._lm.model(input_ids, positions, meta, intermediate_tensors, inputs_embeds)

    # ---- images (first pipeline stage, built with load_vision) ------------------------------
    @property
    def image_token_id(self) -> int:
        """The prompt token whose positions take image features (<|patch|>)."""
        return self.config.vision.image_token_index

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._lm.model.embed_tokens(input_ids)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [tiles, C, H, W] (the tiles of one or more images, in order) -> image
        features [tiles * tokens_per_tile, D] in the text model's hidden size."""
        if self.vision_encoder is None:
            raise ValueError("this model was built without its vision tower (set config.load_vision)")
        return self.vision_encoder(pixel_values)

    def embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        """input_ids [T] with image tokens, pixel_values [tiles, C, H, W] -> inputs_embeds [T, D]:
        the token embeddings with the image features at the image tokens (first stage only)."""
        return merge_image_features(self.embed_input_ids(input_ids), input_ids, self.encode_images(pixel_values),
                                    self.image_token_id)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._lm.lm_head.compute_logits(hidden, out)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self._lm.model.stage_layers()]

    def recurrent_layers(self) -> list[nn.Module]:
        return []  # no linear-attention layers (models/layers/decoder.py)

    def weight_name_rules(self) -> list[NameRule]:
        # First match wins: the shared-expert rules must precede the generic gate/up/down ones.
        p = self._prefix
        # Vision tensors only take the encoder's prefix: their names are the encoder's own (a rule
        # maps a name once, so these come first and keep q_proj etc. away from the text QKV rules).
        vision = [NameRule(f"vision_encoder.{n}", n) for n in ("vision_model", "multi_modal_projector")] \
            if self.vision_encoder is not None else []
        return vision + tied_lm_head_rules(self.config.tie_word_embeddings, f"{p}model.embed_tokens", f"{p}lm_head") + [
            NameRule("feed_forward.gate", "feed_forward.router"),
            NameRule("shared_experts.gate_up_proj", "shared_expert.gate_proj", 0),
            NameRule("shared_experts.gate_up_proj", "shared_expert.up_proj", 1),
            NameRule("shared_experts.down_proj", "shared_expert.down_proj"),
            NameRule("experts.w13_weight", "experts.gate_up_proj", "w13"),
            NameRule("experts.w2_weight", "experts.down_proj", "w2"),
        ] + QKV_RULES + GATE_UP_RULES

    def ignore_checkpoint_name(self, name: str) -> bool:
        if name.startswith(VISION_CHECKPOINT_PREFIXES):
            if self.vision_encoder is not None:
                return False
            if not self._logged_vision_skip:
                logger.info("Skipping the vision tower (vision_model.*, multi_modal_projector.*) of the "
                            "%s checkpoint: only the text model is loaded", self.config.architecture)
                self._logged_vision_skip = True
            return True
        tied = self.config.tie_word_embeddings
        if "rotary_emb.inv_freq" in name or (tied and name.endswith("lm_head.weight")):
            return True
        return skip_other_stage_tensor(name, self, tied, f"{self._prefix}model.embed_tokens")
