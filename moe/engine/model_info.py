"""What both sides of the engine need to know about the model before anything runs: the
checkpoint's config, the resolved sizes (max_model_len, max_num_batched_tokens), device and dtype,
the tokenizer and the EOS ids. The engine core and the API process each resolve it from the same
EngineArgs (cheap: config.json and tokenizer.json only), so nothing of it travels through a socket."""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

from models.registry import load_model_config
from models.tiny import TINY_MODELS, ensure_tiny_model
from moe.config import EngineArgs, parse_mm_limits
from moe.engine.tokenizer import Tokenizer, eos_token_ids, load_tokenizer

logger = logging.getLogger("moe.engine.llm_engine")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a checkpoint needs from a hub repository (not its other weights formats or docs).
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local folder as is; 'tiny-qwen3-moe' built on first use; a Hugging Face hub id
    ('org/name') at `revision` (a branch, tag or commit; None: main) from the local hub cache, else
    downloaded through huggingface_hub."""
    if model in TINY_MODELS:
        return ensure_tiny_model(model)
    if os.path.exists(model) or not _HUB_ID.match(model):
        return model
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise OSError(f"{model!r} is not a local folder, and looks like a Hugging Face hub id, but huggingface_hub "
                      "is not installed (pip install huggingface_hub)") from None
    try:
        return snapshot_download(model, revision=revision, allow_patterns=_HUB_FILES, local_files_only=True)
    except Exception:
        pass  # not cached: download it
    try:
        return snapshot_download(model, revision=revision, allow_patterns=_HUB_FILES)
    except Exception as e:
        raise OSError(f"{model!r} is not a local folder nor in the Hugging Face cache ({_hub_cache()}), and "
                      f"downloading it failed ({type(e).__name__}: {e}); offline, download it first or pass a "
                      "checkpoint folder") from None


def _hub_cache() -> str:
    try:
        from huggingface_hub import constants
        return constants.HF_HUB_CACHE
    except Exception:
        return "~/.cache/huggingface/hub"


@dataclass
class ModelInfo:
    args: EngineArgs
    model_path: str
    model_cls: type
    model_config: object
    max_model_len: int
    max_num_batched_tokens: int
    device: torch.device
    dtype: torch.dtype
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    image_limit: int = 0   # images per prompt (0: the model takes none, or limit_mm_per_prompt turned them off)
    max_image_embeds: int = 0  # encoder features of the largest image the processor makes

    @property
    def max_logprobs(self) -> int:
        return self.model_config.vocab_size if self.args.max_logprobs == -1 else self.args.max_logprobs


def resolve_model_info(args: EngineArgs) -> ModelInfo:
    """Validate the arguments against the checkpoint's config; raises before any process starts."""
    args.validate()
    model_path = resolve_model_path(args.model, args.revision)
    model_cls, cfg = load_model_config(model_path)
    validate_parallel(args, cfg, model_cls)
    max_model_len = args.max_model_len or cfg.max_position_embeddings
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    cfg.limit_positions(max_model_len)
    image_limit = resolve_images(args, cfg)
    max_image_embeds = max_image_embeddings(model_path, cfg) if image_limit else 0
    tokenizer = load_tokenizer(args.tokenizer or model_path)
    if args.tokenizer is not None and tokenizer is None:
        raise OSError(f"no tokenizer.json found at tokenizer={args.tokenizer!r}")
    return ModelInfo(
        args, model_path, model_cls, cfg, max_model_len,
        args.max_num_batched_tokens or (8192 if args.enable_chunked_prefill else max(8192, max_model_len)),
        args.resolve_device(), args.resolve_dtype(cfg.torch_dtype), tokenizer,
        eos_token_ids(model_path, tokenizer, cfg.eos_token_ids), image_limit, max_image_embeds)


# Images per prompt when limit_mm_per_prompt does not say (vLLM's limit for Llama-4 too).
DEFAULT_IMAGE_LIMIT = 10


def resolve_images(args: EngineArgs, cfg) -> int:
    """How many images a prompt may hold; builds the vision tower (config.load_vision) when > 0."""
    vision = getattr(cfg, "vision", None)
    why = getattr(cfg, "vision_error", None)
    if vision is not None:
        vision.mm_encoder_tp_mode = args.mm_encoder_tp_mode
        try:
            vision.check()
        except ValueError as e:
            vision, why = None, str(e)
    asked = "image" in parse_mm_limits(args.limit_mm_per_prompt)
    limit = args.image_limit(DEFAULT_IMAGE_LIMIT if vision is not None else 0)
    if not limit:
        return 0
    if vision is None:
        if asked:
            raise ValueError(f"limit_mm_per_prompt={args.limit_mm_per_prompt!r}: the model ({type(cfg).__name__}) "
                             "takes no images" + (f" (its vision_config: {why})" if why else ""))
        logger.warning("The checkpoint's vision tower cannot be built (%s): serving the text model only", why)
        return 0
    tp = args.tensor_parallel_size
    if args.mm_encoder_tp_mode == "weights" and vision.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the vision tower's num_attention_heads="
                         f"{vision.num_attention_heads}: set mm_encoder_tp_mode='data' (each rank keeps the whole "
                         "encoder and takes its share of the tiles)")
    cfg.load_vision = True
    return limit


def max_image_embeddings(model_path: str, cfg) -> int:
    """The most tiles the image processor makes of one image (max_patches + the global tile) x
    the features per tile."""
    from moe.multimodal.llama4_image_processor import Llama4ImageProcessor

    return (Llama4ImageProcessor.from_pretrained(model_path).max_patches + 1) * cfg.vision.tokens_per_tile


def validate_parallel(args: EngineArgs, cfg, model_cls: type | None = None) -> None:
    """Every size must divide what it splits; raised before any process starts."""
    tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
    if pp > 1 and model_cls is not None and not getattr(model_cls, "supports_pp", False):
        raise ValueError(f"pipeline_parallel_size={pp}: {model_cls.__name__} does not support pipeline "
                         "parallelism yet (see models/parallel/pipeline.py for how a model adopts it)")
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads="
                         f"{cfg.num_attention_heads}")
    if cfg.num_key_value_heads % tp and tp % cfg.num_key_value_heads:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={cfg.num_key_value_heads} "
                         "must divide one another")
    if cfg.vocab_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide vocab_size={cfg.vocab_size}")
    if cfg.intermediate_size and cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={cfg.intermediate_size}")
    if cfg.num_hidden_layers % pp:
        raise ValueError(f"pipeline_parallel_size={pp} does not divide num_hidden_layers={cfg.num_hidden_layers}")
    num_experts = next((getattr(cfg, n) for n in ("num_experts", "n_routed_experts", "num_local_experts")
                        if getattr(cfg, n, 0)), 0)
    if num_experts and args.enable_expert_parallel:
        if num_experts % (dp * tp):
            raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} (the expert-parallel size "
                             f"with enable_expert_parallel) does not divide the {num_experts} experts")
        eplb = args.eplb
        if eplb is not None and (num_experts + eplb.num_redundant_experts) % (dp * tp):
            raise ValueError(f"EPLB: {num_experts} experts + eplb_config['num_redundant_experts']="
                             f"{eplb.num_redundant_experts} physical slots do not divide over the {dp * tp} "
                             "expert-parallel ranks (data_parallel_size x tensor_parallel_size)")
    elif num_experts:
        moe_inter = getattr(cfg, "moe_intermediate_size", 0) or getattr(cfg, "intermediate_size_moe", 0)
        if moe_inter and moe_inter % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide moe_intermediate_size={moe_inter} "
                             "(experts are tensor-parallel without enable_expert_parallel)")
