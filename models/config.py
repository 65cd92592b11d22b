"""Typed model configuration, parsed once from a Hugging Face `config.json`.

Models read these dataclasses, never the raw dict. Each family subclasses `ModelConfig` with
its own fields and a `from_hf` that reads them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from scheduler.kv_cache_spec import RECURRENT_STATE

_MISSING = object()

# Integer fields of the supported families' config.json (top level or text_config): checked before
# parsing, so a bad value is reported by name rather than as `invalid literal for int()`.
_POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size",
                        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "n_group",
                        "topk_group", "moe_layer_freq", "decoder_sparse_step", "intermediate_size_mlp",
                        "attention_chunk_size", "interleave_moe_layer_step", "no_rope_layer_interval")
_NON_NEGATIVE_INT_FIELDS = ("intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
                            "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace", "q_lora_rank")
# torch_dtype values a checkpoint may declare: the engine computes in these (FP8 checkpoints declare
# their compute dtype and carry `quantization_config`).
SUPPORTED_TORCH_DTYPES = ("float32", "float16", "bfloat16", "float", "half")


def hf_get(cfg: dict, *keys: str, default: Any = _MISSING) -> Any:
    """The first of `keys` present in `cfg` (HF renamed several fields across releases)."""
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is _MISSING:
        raise ValueError(f"config.json lacks the field {keys[0]!r}" +
                         (f" (also looked for {', '.join(map(repr, keys[1:]))})" if len(keys) > 1 else ""))
    return default


def check_field_types(cfg: dict) -> None:
    """Integer sizes are integers (an integral float such as 4096.0 passes) and in range, and
    torch_dtype is one the engine computes in; raises naming the field."""
    sections = [("", cfg)] + ([("text_config.", cfg["text_config"])] if isinstance(cfg.get("text_config"), dict)
                              else [])
    for prefix, section in sections:
        for key, low in [(k, 1) for k in _POSITIVE_INT_FIELDS] + [(k, 0) for k in _NON_NEGATIVE_INT_FIELDS]:
            value = section.get(key)
            if value is None:
                continue
            integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if isinstance(value, bool) or not integral:
                raise ValueError(f"field {prefix}{key}={value!r} must be an integer")
            if value < low:
                raise ValueError(f"field {prefix}{key}={value!r} must be {'positive' if low else '>= 0'}")
        dtype = section.get("torch_dtype", section.get("dtype"))
        if dtype is not None and str(dtype).replace("torch.", "") not in SUPPORTED_TORCH_DTYPES:
            raise ValueError(f"field {prefix}torch_dtype={dtype!r} is not supported: the weights must be "
                             f"floating point ({', '.join(SUPPORTED_TORCH_DTYPES[:3])}; FP8 checkpoints declare "
                             "their compute dtype and a quantization_config)")


def check_moe_fields(experts_field: str, num_experts: int, top_k: int, n_group: int = 1,
                     topk_group: int = 1) -> None:
    """The MoE routing fields agree: 1 <= top-k <= experts, groups divide the experts,
    topk_group <= n_group and the chosen groups hold at least top-k experts."""
    if num_experts == 0:
        return  # a dense model
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"field num_experts_per_tok={top_k} must be between 1 and {experts_field}={num_experts}")
    if num_experts % n_group:
        raise ValueError(f"field n_group={n_group} does not divide {experts_field}={num_experts}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"field topk_group={topk_group} must be between 1 and n_group={n_group}")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(f"field num_experts_per_tok={top_k} exceeds the {topk_group * (num_experts // n_group)} "
                         f"experts of the topk_group={topk_group} groups a token may use")


@dataclass
class RopeConfig:
    """RoPE base and scaling, from `rope_theta` + `rope_scaling` or from `rope_parameters`."""
    theta: float = 10000.0
    scaling_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    # Scaling-type specific parameters (yarn: beta_fast, beta_slow, mscale, mscale_all_dim;
    # llama3: low_freq_factor, high_freq_factor), kept typed as floats.
    params: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg: dict) -> "RopeConfig":
        rope = dict(cfg.get("rope_parameters") or {})
        if not rope.get("rope_type") and not rope.get("type"):
            rope.update(cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default")) or "default"
        orig = rope.get("original_max_position_embeddings")
        skip = {"rope_theta", "rope_type", "type", "factor", "original_max_position_embeddings"}
        params = {k: float(v) for k, v in rope.items() if k not in skip and isinstance(v, (int, float))}
        return cls(float(theta), str(kind), float(rope.get("factor", 1.0) or 1.0),
                   int(orig) if orig else None, params)


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str | None

    @property
    def rope_max_position(self) -> int:
        """Positions a RoPE table needs: max_position_embeddings, or max_model_len once the
        engine has set it with `limit_positions` (a 10M-position table would take GBs)."""
        limit = getattr(self, "_max_model_len", None)
        return min(self.max_position_embeddings, limit) if limit else self.max_position_embeddings

    def limit_positions(self, max_model_len: int) -> None:
        self._max_model_len = max_model_len

    def kv_cache_keys(self) -> list:
        """Per layer, its KV-cache group key: None for full attention, the chunk size of a
        chunked-local layer, RECURRENT_STATE for a linear-attention one (groups of their own:
        scheduler/kv_cache_spec.py); families with sliding-window layers override it."""
        types = getattr(self, "layer_types", None) or [None] * self.num_hidden_layers
        chunk = getattr(self, "attention_chunk_size", None)
        return [RECURRENT_STATE if types[i] == "linear_attention" else
                chunk if chunk and types[i] == "chunked_attention" else None for i in range(self.num_hidden_layers)]

    @classmethod
    def common_fields(cls, cfg: dict, architecture: str) -> dict:
        hidden = int(hf_get(cfg, "hidden_size"))
        heads = int(hf_get(cfg, "num_attention_heads"))
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            # Every MLP and expert here is SwiGLU: another activation would run as SiLU silently.
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
        return dict(
            architecture=architecture,
            model_type=str(cfg.get("model_type", "")),
            vocab_size=int(hf_get(cfg, "vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=int(hf_get(cfg, "num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=int(hf_get(cfg, "num_key_value_heads", default=heads)),
            head_dim=int(hf_get(cfg, "head_dim", default=hidden // heads)),
            intermediate_size=int(hf_get(cfg, "intermediate_size", default=0)),
            rms_norm_eps=float(hf_get(cfg, "rms_norm_eps", default=1e-6)),
            max_position_embeddings=int(hf_get(cfg, "max_position_embeddings", default=4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope=RopeConfig.from_hf(cfg),
            eos_token_ids=_token_ids(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype", cfg.get("dtype")),
        )

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str) -> "ModelConfig":
        return cls(**cls.common_fields(cfg, architecture))


def read_hf_config(model_dir: str) -> dict:
    """The raw `config.json` of a checkpoint folder, with clear errors for a missing or bad file."""
    if not os.path.isdir(model_dir):
        raise OSError(f"model folder {model_dir!r} does not exist (expected a folder with config.json "
                      "and *.safetensors, or the built-in name 'tiny-qwen3-moe')")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise OSError(f"{model_dir!r} has no config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    try:
        check_field_types(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return cfg
