"""Engine arguments with vLLM's names, and their validation."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass

import torch

from kernels.batch_invariant import requested_by_environment as batch_invariant_requested_by_environment
from models.fp8 import QUANTIZATION_CHOICES as QUANTIZATIONS  # None (auto) | "fp8" | "none"
from moe.structured_output.config import StructuredOutputsConfig

logger = logging.getLogger("moe.config")

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
ALL2ALL_BACKENDS = ("auto", "allgather_reducescatter", "all_to_all", "low_latency")
EXPERT_PLACEMENT_STRATEGIES = ("linear", "round_robin")
# None: in-process for one rank, "mp" (spawned workers) for more, "external_launcher" under torchrun.
DISTRIBUTED_EXECUTOR_BACKENDS = (None, "uni", "mp", "external_launcher")
# The expert-layer backends of kernels/fused_moe.py; None picks the best one for the device.
MOE_BACKENDS = (None, "torch", "triton", "deepspeed")
MM_ENCODER_TP_MODES = ("weights", "data")
MM_PROCESSOR_CACHE_TYPES = ("lru", "shm")
MM_MODALITIES = ("image",)
# The tokenizer is always tokenizer.json through the fast `tokenizers` library: "auto" and "hf"
# (vLLM's names for the Hugging Face tokenizer, fast where there is one) are what that honours.
TOKENIZER_MODES = ("auto", "hf")
# FP8 KV caches, as vLLM names them ("fp8" is e4m3), quantised with per-tensor scales per layer
# (kernels/attention.py); vLLM's Gaudi and sparse-MLA formats are refused.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
UNSUPPORTED_KV_CACHE_DTYPES = ("fp8_inc", "fp8_ds_mla")
# vLLM arguments accepted so that vLLM scripts run, which change nothing here; each is warned
# about (once, together) when set to anything but its no-op value.
NO_EFFECT_ARGS = {
    "swap_space": (None, "no CPU swap space: a preempted request's KV cache is recomputed, as in vLLM's V1"),
    "cpu_offload_gb": (0, "weights are never offloaded to the CPU"),
    "disable_custom_all_reduce": (False, "there is no custom all-reduce: collectives go through torch.distributed"),
}


@dataclass(frozen=True)
class EPLBConfig:
    """Expert-parallel load balancing (vLLM's `eplb_config` keys and defaults): every
    `step_interval` engine steps the experts are re-placed from the load of the last `window_size`
    steps, with `num_redundant_experts` extra physical slots for replicas of the hottest experts."""
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False

    @classmethod
    def parse(cls, value: "EPLBConfig | dict | str | None") -> "EPLBConfig":
        """From a dict, a JSON string (the CLI's --eplb-config) or None (the defaults)."""
        if value is None or isinstance(value, EPLBConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"eplb_config must be a JSON object, got {value!r} ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"eplb_config must be a dict with keys {_EPLB_KEYS}, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_EPLB_KEYS))
        if unknown:
            raise ValueError(f"eplb_config has unknown key(s) {unknown}; the keys are {_EPLB_KEYS}")
        for key in ("window_size", "step_interval", "num_redundant_experts"):
            v = value.get(key)
            low = 0 if key == "num_redundant_experts" else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"eplb_config['{key}'] must be an integer >= {low}, got {v!r}")
        flag = value.get("log_balancedness", False)
        if not isinstance(flag, bool):
            raise ValueError(f"eplb_config['log_balancedness'] must be true or false, got {flag!r}")
        return cls(**value)


_EPLB_KEYS = tuple(f.name for f in dataclasses.fields(EPLBConfig))


def parse_mm_limits(value: dict | str | None) -> dict[str, int]:
    """limit_mm_per_prompt as {modality: count}; raises naming a bad key or count."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt must be a JSON object like '{{\"image\": 2}}', got {value!r} "
                             f"({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict like {{'image': 2}}, got {type(value).__name__}")
    unknown = sorted(set(value) - set(MM_MODALITIES))
    if unknown:
        raise ValueError(f"limit_mm_per_prompt has unsupported modality {unknown}; supported: {MM_MODALITIES}")
    for key, count in value.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"limit_mm_per_prompt['{key}'] must be an integer >= 0, got {count!r}")
    return dict(value)


# The help text of each engine argument's flag (EngineArgs.add_cli_args appends its default);
# docs/engine_args.md has the long form. Every field of EngineArgs needs one.
ENGINE_ARG_HELP = {
    "model": "checkpoint folder (config.json, *.safetensors, tokenizer.json), or 'tiny-qwen3-moe', the built-in "
             "model",
    "tokenizer": "folder with tokenizer.json (default: %(default)s: the model folder)",
    "dtype": "model dtype: auto (the checkpoint's torch_dtype, else float32), float32 (float), bfloat16 or "
             "float16 (half)",
    "seed": "seed of the engine's shared random generator (samples of requests without a seed of their own) "
            "and of dummy weights",
    "max_model_len": "longest prompt + output, in tokens; more than the model's max_position_embeddings is an "
                     "error (default: %(default)s: max_position_embeddings)",
    "block_size": "tokens per KV-cache block",
    "max_num_seqs": "most requests (sequences) in one engine step",
    "max_num_batched_tokens": "token budget of one engine step (default: %(default)s: 8192, and without chunked "
                              "prefill at least max_model_len)",
    "gpu_memory_utilization": "share of the GPU's memory for weights, activations and the KV cache, in (0, 1]",
    "num_gpu_blocks_override": "exact number of KV-cache blocks, over the sizing rules (default: %(default)s: sized "
                               "from memory)",
    "kv_cache_memory_bytes": "KV-cache size in bytes (default: %(default)s: on the CPU 1 GiB, capped at what "
                             "max_num_seqs full-length requests can use; on a GPU what gpu_memory_utilization "
                             "leaves)",
    "enable_prefix_caching": "reuse the KV-cache blocks of prompt prefixes that earlier requests computed",
    "enable_chunked_prefill": "split long prompts over several steps, within the token budget",
    "load_format": "auto or safetensors (the checkpoint's weights), or dummy (random weights at the real size; "
                   "the folder may hold config.json alone)",
    "disable_log_stats": "no periodic log lines of throughput, running and waiting requests, KV-cache use, "
                         "prefix-cache hits and expert-load balancedness",
    "device": "auto (CUDA when present, else the CPU), cpu, cuda or cuda:N",
    "tensor_parallel_size": "ranks that split attention, dense MLPs, embeddings and lm_head",
    "pipeline_parallel_size": "pipeline stages, each holding consecutive layers",
    "data_parallel_size": "engine replicas, each with its own scheduler; a new request goes to the least loaded",
    "enable_expert_parallel": "MoE layers hold whole experts, spread over the TP x DP ranks (off: each expert "
                              "is split along its intermediate size over the TP ranks)",
    "all2all_backend": "token dispatch under expert parallelism: auto (chosen by the device and the expected "
                       "bytes per rank), allgather_reducescatter, all_to_all or low_latency (fixed-size buffers: "
                       "decode steps replay CUDA graphs)",
    "expert_placement_strategy": "experts per expert-parallel rank: linear (contiguous ids) or round_robin "
                                 "(EPLB needs linear)",
    "distributed_executor_backend": "mp (a worker process per rank), uni (one process, world size 1) or "
                                    "external_launcher (ranks started by torchrun) (default: %(default)s: uni "
                                    "for one rank, mp for more, external_launcher under torchrun)",
    "moe_backend": "kernel of the expert layers: torch, triton or deepspeed (default: %(default)s: the best "
                   "for the device)",
    "quantization": "FP8 block-quantised and MXFP4 (gpt-oss) checkpoints: fp8 / mxfp4 (the routed experts stay "
                    "FP8 / MXFP4 wherever the engine runs) or none (every weight dequantised at load) (default: "
                    "%(default)s: the routed experts stay FP8 / MXFP4 on CUDA with the Triton kernel, the rest is "
                    "dequantised)",
    "trust_remote_code": "accepted for vLLM compatibility: no remote code ever runs, only the built-in "
                         "architectures (on: a warning)",
    "max_logprobs": "the largest logprobs a request may ask for (-1: the whole vocabulary)",
    "enforce_eager": "on CUDA, run every step eagerly instead of replaying CUDA graphs",
    "cudagraph_capture_sizes": "decode batch sizes captured as CUDA graphs at start-up, space-separated (default: "
                               "%(default)s: 1, 2, 4, then every multiple of 8 up to max_num_seqs, and "
                               "max_num_seqs)",
    "async_scheduling": "schedule and launch step N+1 before step N's tokens reach the host (default: "
                        "%(default)s: on for a single-process engine of a text model on CUDA, else off)",
    "record_expert_load": "count the tokens routed to each expert, on the device (LLM.get_expert_load, "
                          "/metrics, /dashboard)",
    "enable_return_routed_experts": "return the experts each MoE layer's router chose for every forwarded token "
                                    "(CompletionOutput.routed_experts, [tokens, MoE layers, top_k] int16; the "
                                    "server adds it to each choice as base64 of the .npy)",
    "batch_invariant": "bit-identical tokens and logprobs for a request whatever it is batched with and however its "
                       "prefill is chunked: fixed-tile GEMMs, expert kernel and attention (slower; one rank; "
                       "MOE_BATCH_INVARIANT=1 or VLLM_BATCH_INVARIANT=1 turns it on too)",
    "enable_sleep_mode": "accepted for vLLM compatibility: LLM.sleep / wake_up (and the server's /sleep, /wake_up "
                         "with VLLM_SERVER_DEV_MODE=1) work with or without it",
    "expert_load_window_steps": "engine steps per expert-load window (the recording, the dashboard, the metrics)",
    "enable_eplb": "expert-parallel load balancing: experts re-placed, and the hottest replicated, from their "
                   "measured load (needs --enable-expert-parallel and TP x DP >= 2)",
    "eplb_config": "EPLB settings as JSON, e.g. '{\"window_size\": 1000, \"step_interval\": 3000, "
                   "\"num_redundant_experts\": 32, \"log_balancedness\": true}' (default: %(default)s: window_size "
                   "1000, step_interval 3000, no redundant experts, no logging)",
    "limit_mm_per_prompt": "images per prompt as JSON, e.g. '{\"image\": 2}'; '{\"image\": 0}' serves the text "
                           "model alone (default: %(default)s: 10 images for a multimodal checkpoint)",
    "mm_encoder_tp_mode": "the vision encoder under tensor parallelism: weights (its linears split over the TP "
                          "ranks) or data (each rank encodes its share of the tiles with the whole encoder)",
    "mm_processor_cache_gb": "GiB of processed images cached by hash, and the size of each side of the IPC cache "
                             "or of the shared-memory store (0: off)",
    "mm_processor_cache_type": "how processed images reach an engine core under moe serve: lru (a repeated "
                               "image travels as its hash) or shm (a shared-memory store the workers read)",
    "mm_shm_cache_max_object_size_mb": "largest processed image, in MiB, that the shared-memory store takes; "
                                       "larger ones travel inline",
    "tokenizer_mode": "auto or hf: both load tokenizer.json through the fast tokenizers library, the only loader",
    "revision": "branch, tag or commit of a hub model id; a local folder ignores it (default: %(default)s: "
                "main)",
    "structured_outputs_config": "structured outputs as JSON, e.g. '{\"backend\": \"xgrammar\"}': backend auto "
                                 "(xgrammar when installed and able, else llguidance), guidance or xgrammar; "
                                 "disable_any_whitespace, disable_additional_properties",
    "kv_cache_dtype": "dtype of the KV cache: auto (the model dtype) or a dtype by name (docs/engine_args.md "
                      "lists those accepted)",
    **{name: f"accepted for vLLM compatibility, without effect: {why}"
       for name, (_, why) in NO_EFFECT_ARGS.items()},
}


@dataclass
class EngineArgs:
    """Engine arguments (vLLM's names; docs/engine_args.md has the full table).

    quantization: how an FP8 block-quantised checkpoint (config.json `quantization_config`,
    quant_method "fp8", `weight_block_size`) is served. None (auto): the routed experts stay
    FP8 and run the Triton FP8 kernel when the device is CUDA, Triton is available and
    moe_backend is None or "triton"; every other FP8 weight (attention, dense MLPs, shared
    experts), and everything elsewhere, is dequantised at load on the CPU. "fp8": keep the routed
    experts FP8 wherever the engine runs (on the CPU, or with moe_backend="torch", the expert
    layer dequantises on every call: slow, for tests); an error for a checkpoint that is not
    block-FP8. "mxfp4": the same for an MXFP4 checkpoint (gpt-oss; its auto rule is FP8's). "none":
    dequantise every quantised weight at load. Unquantised checkpoints ignore it.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    load_format: str = "auto"
    disable_log_stats: bool = True
    device: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    all2all_backend: str = "auto"
    expert_placement_strategy: str = "linear"
    distributed_executor_backend: str | None = None
    moe_backend: str | None = None
    quantization: str | None = None
    trust_remote_code: bool = False  # accepted for vLLM compatibility; nothing remote is ever run
    max_logprobs: int = 20           # the largest SamplingParams.logprobs accepted (-1: the vocabulary)
    # On CUDA, decode-only steps replay CUDA graphs captured at start-up for these batch sizes
    # (None: 1, 2, 4, 8, 16, ... up to max_num_seqs); enforce_eager=True captures none.
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    # Schedule and launch step N+1 before step N's tokens reach the host, so the host's work of a
    # step overlaps the GPU's (single-process engines, text models; other layouts run synchronously).
    # None: on where it runs and pays (a single-process engine of a text model on CUDA), else off.
    async_scheduling: bool | None = None
    # Expert load: counted on the device in every MoE layer, folded into a window every
    # expert_load_window_steps engine steps (LLM.get_expert_load, the recording, /metrics).
    record_expert_load: bool = True
    expert_load_window_steps: int = 100
    # Router replay: the logical experts each MoE layer chose for every token that went through a
    # forward (prompt and generated, all but the last sampled), returned with the finished output.
    enable_return_routed_experts: bool = False
    # A request's results independent of its batch, its chunking and its place in the batch
    # (kernels/batch_invariant.py); MOE_BATCH_INVARIANT=1 (else VLLM_BATCH_INVARIANT=1) turns it on too.
    batch_invariant: bool = False
    # vLLM needs it for LLM.sleep / wake_up; here they always work (the flag is accepted).
    enable_sleep_mode: bool = False
    # EPLB (expert parallelism only): a dict/JSON with EPLBConfig's keys.
    enable_eplb: bool = False
    eplb_config: dict | str | None = None
    # Multimodal checkpoints (Llama-4): images per prompt ({"image": N} or its JSON; {"image": 0}
    # serves the text model alone, without the vision tower), how the vision encoder uses tensor
    # parallelism ("weights": its linears split; "data": each TP rank encodes its share of the
    # tiles with the whole encoder), and the cache of processed images ("lru" in the API process
    # with only keys sent to the engine core on a hit, or "shm": a shared-memory store the workers
    # read; 0 GiB turns it off).
    limit_mm_per_prompt: dict | str | None = None
    mm_encoder_tp_mode: str = "weights"
    mm_processor_cache_gb: float = 4.0
    mm_processor_cache_type: str = "lru"
    mm_shm_cache_max_object_size_mb: int = 128
    # vLLM's model and cache arguments (docs/vllm_compatibility.md).
    tokenizer_mode: str = "auto"
    revision: str | None = None      # a hub revision; applies to hub ids (see validate)
    # "auto": the model dtype; "fp8" (= "fp8_e4m3") / "fp8_e5m2": an FP8 cache with per-tensor
    # scales (half a bf16 cache's bytes); another explicit dtype must be the model's.
    kv_cache_dtype: str = "auto"
    # Structured outputs: the grammar library (StructuredOutputsConfig's keys, as vLLM's).
    structured_outputs_config: dict | str | None = None
    swap_space: float | None = None  # accepted, no effect (NO_EFFECT_ARGS)
    cpu_offload_gb: float = 0.0      # accepted, no effect
    disable_custom_all_reduce: bool = False  # accepted, no effect

    def image_limit(self, default: int) -> int:
        """Images allowed per prompt (limit_mm_per_prompt["image"], else the model's default)."""
        limits = parse_mm_limits(self.limit_mm_per_prompt)
        return limits.get("image", default)

    @property
    def batch_invariant_on(self) -> bool:
        """batch_invariant, or MOE_BATCH_INVARIANT=1 (else VLLM_BATCH_INVARIANT=1) in the environment."""
        return self.batch_invariant or batch_invariant_requested_by_environment()

    @property
    def eplb(self) -> EPLBConfig | None:
        """The parsed EPLB settings when enable_eplb, else None."""
        return EPLBConfig.parse(self.eplb_config) if self.enable_eplb else None

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        return torch.device(self.device)

    def resolve_dtype(self, config_dtype: str | None) -> torch.dtype:
        """The model dtype (kv_cache_dtype is checked against it: an explicit non-FP8 one must match)."""
        model_dtype = self._model_dtype(config_dtype)
        self.resolve_kv_cache_dtype(model_dtype)
        return model_dtype

    def _model_dtype(self, config_dtype: str | None) -> torch.dtype:
        if self.dtype == "auto":
            return DTYPES.get(str(config_dtype).replace("torch.", ""), torch.float32) if config_dtype else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype: an FP8 one for "fp8" / "fp8_e4m3" / "fp8_e5m2", else the
        model's (attention reads and writes the cache in it)."""
        self._check_kv_cache_dtype()
        if self.kv_cache_dtype in FP8_KV_CACHE_DTYPES:
            return FP8_KV_CACHE_DTYPES[self.kv_cache_dtype]
        if self.kv_cache_dtype != "auto" and DTYPES[self.kv_cache_dtype] != model_dtype:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} differs from the model dtype "
                             f"{str(model_dtype).removeprefix('torch.')}: the KV cache is kept in the model dtype, "
                             "so use kv_cache_dtype='auto' (or set dtype to the same value)")
        return model_dtype

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype in UNSUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use 'auto' (the model "
                             f"dtype) or an FP8 cache: {', '.join(repr(n) for n in FP8_KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES \
                and self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPES) + list(FP8_KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

    def validate(self) -> None:
        """Checks that need no model; model-dependent checks run at load."""
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size",
                     "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be one of {ALL2ALL_BACKENDS}, got {self.all2all_backend!r}")
        if self.expert_placement_strategy not in EXPERT_PLACEMENT_STRATEGIES:
            raise ValueError(f"expert_placement_strategy must be one of {EXPERT_PLACEMENT_STRATEGIES}, "
                             f"got {self.expert_placement_strategy!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                             f"got {self.distributed_executor_backend!r}")
        world = self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size
        if self.distributed_executor_backend == "uni" and world > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size x "
                             f"pipeline_parallel_size x data_parallel_size = {world}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.cudagraph_capture_sizes is not None and (
                not self.cudagraph_capture_sizes or min(self.cudagraph_capture_sizes) < 1):
            raise ValueError(f"cudagraph_capture_sizes must be a non-empty list of positive batch sizes, "
                             f"got {self.cudagraph_capture_sizes}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS} (None: the best for the device), "
                             f"got {self.moe_backend!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary, "
                             f"got {self.max_logprobs!r}")
        if self.expert_load_window_steps < 1:
            raise ValueError(f"expert_load_window_steps must be >= 1, got {self.expert_load_window_steps}")
        parse_mm_limits(self.limit_mm_per_prompt)
        if self.mm_encoder_tp_mode not in MM_ENCODER_TP_MODES:
            raise ValueError(f"mm_encoder_tp_mode must be one of {MM_ENCODER_TP_MODES}, "
                             f"got {self.mm_encoder_tp_mode!r}")
        if self.mm_processor_cache_type not in MM_PROCESSOR_CACHE_TYPES:
            raise ValueError(f"mm_processor_cache_type must be one of {MM_PROCESSOR_CACHE_TYPES}, "
                             f"got {self.mm_processor_cache_type!r}")
        if not self.mm_processor_cache_gb >= 0:
            raise ValueError(f"mm_processor_cache_gb must be >= 0 (0 turns the cache off), got "
                             f"{self.mm_processor_cache_gb!r}")
        if self.mm_shm_cache_max_object_size_mb < 1:
            raise ValueError(f"mm_shm_cache_max_object_size_mb must be >= 1, "
                             f"got {self.mm_shm_cache_max_object_size_mb}")
        StructuredOutputsConfig.parse(self.structured_outputs_config)
        eplb = EPLBConfig.parse(self.eplb_config)  # bad keys or values fail even with EPLB off
        if self.enable_eplb:
            if not self.enable_expert_parallel or self.tensor_parallel_size * self.data_parallel_size < 2:
                raise ValueError("enable_eplb needs expert parallelism: set enable_expert_parallel=True with "
                                 "tensor_parallel_size x data_parallel_size >= 2")
            if self.expert_placement_strategy != "linear":
                raise ValueError("enable_eplb places experts itself: leave expert_placement_strategy 'linear'")
        elif self.eplb_config is not None and eplb.num_redundant_experts:
            logger.warning("eplb_config is given but enable_eplb is False: no rebalancing, no redundant experts")
        if self.batch_invariant_on and world > 1:
            raise ValueError(f"batch_invariant runs on one rank (tensor_parallel_size x pipeline_parallel_size x "
                             f"data_parallel_size = {world}): the collectives' summation order is not fixed")
        self._validate_vllm_args()
        if self.trust_remote_code:
            logger.warning("trust_remote_code=True is accepted for vLLM compatibility, but no remote code runs: "
                           "the engine only serves its built-in architectures")

    def _validate_vllm_args(self) -> None:
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {TOKENIZER_MODES}, got {self.tokenizer_mode!r}: the "
                             "engine loads tokenizer.json through the fast `tokenizers` library only (no slow, "
                             "mistral or custom tokenizers)")
        self._check_kv_cache_dtype()
        if self.revision is not None:
            if not isinstance(self.revision, str) or not self.revision:
                raise ValueError(f"revision must be a branch, tag or commit of the model's hub repository, "
                                 f"got {self.revision!r}")
        for name in ("swap_space", "cpu_offload_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a number >= 0 (GiB), got {value!r}")
        given = [name for name, (noop, _) in NO_EFFECT_ARGS.items() if getattr(self, name) != noop]
        if given:
            logger.warning("accepted for vLLM compatibility, but without effect here: %s",
                           "; ".join(f"{n}={getattr(self, n)!r} ({NO_EFFECT_ARGS[n][1]})" for n in given))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_required: bool = True) -> None:
        """--kebab-case flags for every field, as vLLM's CLI spells them (with its -tp / -pp / -dp), each
        with its ENGINE_ARG_HELP text and default (shown whatever the parser's formatter)."""
        short = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp"}
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-")] + ([short[f.name]] if f.name in short else [])
            if f.name == "model":
                action = parser.add_argument(*flags, required=model_required, default=None)
            elif f.type in ("bool", bool, "bool | None"):
                action = parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default)
            elif str(f.type).startswith("list[int]"):
                action = parser.add_argument(*flags, type=int, nargs="+", default=f.default)
            elif f.name in ("limit_mm_per_prompt", "eplb_config", "structured_outputs_config"):  # JSON text
                action = parser.add_argument(*flags, type=str, default=None)
            else:
                kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
                action = parser.add_argument(*flags, type=kind, default=f.default)
            # Set after add_argument: Python 3.10's BooleanOptionalAction would append a second default.
            text = ENGINE_ARG_HELP[f.name]
            action.help = text if f.name == "model" or "%(default)" in text else text + " (default: %(default)s)"

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
