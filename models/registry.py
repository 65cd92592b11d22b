"""Architecture name (config.json `architectures[0]`) -> model class."""
from __future__ import annotations

import importlib
import os

from models.config import ModelConfig, read_hf_config

_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": ("models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Llama4ForCausalLM": ("models.llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("models.llama4", "Llama4ForCausalLM"),
    "MixtralForCausalLM": ("models.mixtral", "MixtralForCausalLM"),
    "Glm4MoeForCausalLM": ("models.glm4_moe", "Glm4MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "GptOssForCausalLM": ("models.gpt_oss", "GptOssForCausalLM"),
    "Qwen3NextForCausalLM": ("models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("models.qwen3_next", "Qwen3NextForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(hf_config: dict) -> type:
    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; supported architectures: "
                         + ", ".join(supported_architectures()))
    for arch in archs:
        if arch in _ARCHITECTURES:
            module, cls = _ARCHITECTURES[arch]
            try:
                return getattr(importlib.import_module(module), cls)
            except ModuleNotFoundError as e:
                if e.name != module:
                    raise
                raise ValueError(f"model architecture {arch!r} is not available in this build yet") from None
    raise ValueError(f"unsupported model architecture {archs[0]!r}; supported architectures: "
                     + ", ".join(supported_architectures()))


def load_model_config(model_dir: str) -> tuple[type, ModelConfig]:
    """(model class, typed config) for a checkpoint folder."""
    raw = read_hf_config(model_dir)  # checks the field types
    cls = resolve_architecture(raw)
    arch = next(a for a in raw["architectures"] if a in _ARCHITECTURES)
    try:
        return cls, cls.config_class.from_hf(raw, arch)
    except (ValueError, TypeError) as e:  # name the file: the message names the field
        raise ValueError(f"{os.path.join(model_dir, 'config.json')}: {e}") from None
