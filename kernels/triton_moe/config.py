"""Tuned launch configs for the expert GEMMs: JSON files keyed by (E, N, device, dtype[, block]).

File names (in kernels/configs/), vLLM-style:

    E={E},N={N},device_name={device},dtype={dtype}[,block_shape=[{bn},{bk}]].json

E local experts, N the expert intermediate size F (w2.shape[2]), device the CUDA device name
with spaces replaced by '_' (e.g. NVIDIA_H200), dtype one of bf16, fp16, fp32, fp8_w8a8
(the activation/weight compute dtype) or mxfp4 (MXFP4 weights, whatever the activation dtype; its
configs need BLOCK_SIZE_K a multiple of 32), block_shape only for block-quantised FP8 weights.

Contents: {"<M>": {"BLOCK_SIZE_M": .., "BLOCK_SIZE_N": .., "BLOCK_SIZE_K": .., "GROUP_SIZE_M": ..,
"num_warps": .., "num_stages": .., "down": {...optional overrides for the down GEMM...}}, ...}
where M is the number of tokens T of the tuned batch; the nearest bucket is used at run time.
Optional keys under "down": "ATOMIC_SUM": true (the down GEMM adds its rows into a zeroed fp32
[T, D] with atomics, fusing the top-k sum) and "SPLIT_K": n > 1 (n programs share one down
tile's F range; implies ATOMIC_SUM), for decode shapes with too few down tiles to fill the GPU.
Optional "HALF_TILES": true (top level: both GEMMs; under "down": the down GEMM alone), BLOCK_SIZE_M >= 32:
an expert's last block with no rows in its upper half runs a tile of BLOCK_SIZE_M / 2 rows (gemm.py).
Optional top-level "SPLIT_K": n > 1, the gate_up GEMM alone (not FP8): n programs share one tile's D
range, adding into a zeroed fp32 buffer that one more launch turns into h (bias, activation): for
steps of a few tokens, whose few gate_up tiles each loop over all of D.
Optional "TMA": true under "down" (16/32-bit weights, no HALF_TILES there): the down GEMM reads h and its
weights through TMA descriptors (Hopper; elsewhere it loads them by pointer, gemm.py).
Optional "SWAP_AB": true (top level or under "down", MXFP4 weights only): the GEMM computes the transposed
product, its dequantised weight tile the MMA's A operand and the rows its narrow N side (gemm.py).
"""
from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

import torch

from kernels import batch_invariant

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
               "num_stages")

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        return dtype
    return _DTYPE_NAMES[dtype]


def device_name(device: torch.device | None = None) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return "cpu"


def config_file_name(E: int, N: int, device: str, dtype: str,
                     block_shape: tuple[int, int] | list[int] | None = None) -> str:
    name = f"E={E},N={N},device_name={device},dtype={dtype}"
    if block_shape is not None:
        name += f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    return name + ".json"


def _config_dirs() -> list[Path]:
    extra = os.environ.get("MOE_KERNEL_CONFIG_DIR")
    return ([Path(extra)] if extra else []) + [CONFIG_DIR]


@functools.lru_cache(maxsize=None)
def load_configs(file_name: str) -> dict[int, dict] | None:
    for d in _config_dirs():
        path = d / file_name
        if path.is_file():
            with open(path) as f:
                return {int(m): cfg for m, cfg in json.load(f).items()}
    return None


@functools.lru_cache(maxsize=None)
def _warn_missing(file_name: str) -> None:
    log.warning("no tuned MoE kernel config %s in %s; using defaults (run `moe tune-moe` to "
                "write it)", file_name, CONFIG_DIR)


def default_config(M: int, E: int, N: int, top_k: int, dtype: str,
                   block_shape: tuple[int, int] | None = None) -> dict:
    """A config that is correct everywhere and reasonable on Hopper when nothing was tuned.
    MXFP4 ("mxfp4") gets the 16-bit buckets (their BLOCK_SIZE_K, 64 and 128, are multiples of 32), its
    decode tiles with SWAP_AB (1.16-1.22x the layer's speed at 1-64 tokens on an H100, BENCHMARKS.md §1)."""
    if block_shape is not None:  # FP8 block-quantised: BLOCK_K must equal the scale group
        bm = 16 if M * top_k <= 4 * E else 64
        return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": block_shape[0], "BLOCK_SIZE_K": block_shape[1],
                "GROUP_SIZE_M": 1 if bm == 16 else 8, "num_warps": 4, "num_stages": 3}
    if M * top_k <= 2 * E:  # few rows per expert: decode, weight-bandwidth bound
        cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
               "num_warps": 4, "num_stages": 3}
        return dict(cfg, SWAP_AB=True) if dtype == "mxfp4" else cfg
    if M * top_k <= 32 * E:
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
            "num_warps": 8, "num_stages": 3}


def nearest_bucket(configs: dict[int, dict], M: int) -> dict:
    return configs[min(configs, key=lambda m: (abs(m - M), m))]


def invariant_config(block_shape: tuple[int, int] | None = None) -> dict:
    """The one config of the batch-invariant mode, whatever the token count: no split-K, no atomics
    (FP8: BLOCK_SIZE_K and gate_up's BLOCK_SIZE_N the scale block, as the kernel needs)."""
    if block_shape is not None:
        return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": block_shape[0], "BLOCK_SIZE_K": block_shape[1],
                "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 3}


def get_config(M: int, E: int, N: int, top_k: int, dtype: torch.dtype | str,
               block_shape: tuple[int, int] | None = None, device: str | None = None) -> dict:
    """Config for T=M tokens: the nearest tuned bucket, else `default_config` (logged once); in
    batch-invariant mode `invariant_config`."""
    if batch_invariant.enabled():
        return invariant_config(block_shape)
    dev = device if device is not None else device_name()
    name = config_file_name(E, N, dev, dtype_name(dtype), block_shape)
    configs = load_configs(name)
    if configs:
        return nearest_bucket(configs, M)
    if dev != "cpu":
        _warn_missing(name)
    return default_config(M, E, N, top_k, dtype_name(dtype), block_shape)


def split_config(cfg: dict) -> tuple[dict, dict]:
    """(gate_up, down) launch parameters; the down GEMM may override all but BLOCK_SIZE_M."""
    up = {k: cfg[k] for k in CONFIG_KEYS}
    if cfg.get("HALF_TILES"):
        up["HALF_TILES"] = True
    if cfg.get("SWAP_AB"):  # both GEMMs unless "down" says otherwise
        up["SWAP_AB"] = True
    down = dict(up)
    if int(cfg.get("SPLIT_K", 1)) > 1:  # gate_up's own; the down GEMM's is under "down"
        up["SPLIT_K"] = int(cfg["SPLIT_K"])
    down.update({k: v for k, v in cfg.get("down", {}).items() if k != "BLOCK_SIZE_M"})
    return up, down
