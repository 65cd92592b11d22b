"""FP8 (e4m3) block-quantised checkpoints (DeepSeek-V3 hub weights): dequantised at load, on the
CPU, except the routed experts when the engine keeps them FP8 (`resolve_fp8_experts`).

A quantised linear weight `X.weight` [out, in] (float8_e4m3fn) comes with `X.weight_scale_inv`
[ceil(out / bo), ceil(in / bi)] fp32 (bo x bi = `weight_block_size`, 128 x 128); the real
weight is `weight.float() * scale` with each scale covering one block (edge blocks partial).

The generic loader sees checkpoint tensors one at a time, in any order, so each quantised
parameter gets a companion fp32 parameter `<weight name>_scale_inv` (same pieces, kept: the
checkpoint's scales, flat, piece after piece) and the two loaders meet in a shared `_Pairing`:
whichever of weight and scale arrives second triggers the dequantisation, which feeds the
weight's own ParamLoader (TP/EP slicing unchanged). A weight whose scale never arrives is
reported missing by its scale's name.

FP8 routed experts: where `Fp8BlockConfig.keep_experts` is set, the model's FusedMoE layers keep
the fp8 weights and own their scales (models/layers/moe.py), and the Triton FP8 kernel reads them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

import kernels
from models.layers.weights import ParamLoader, attach_loader, new_param

logger = logging.getLogger("moe.fp8")

FP8_E4M3_MAX = 448.0
# EngineArgs.quantization: None = auto (from the checkpoint and the device), "fp8" / "mxfp4" = keep
# the routed experts FP8 / MXFP4 wherever the model runs, "none" = dequantise every weight at load.
QUANTIZATION_CHOICES = (None, "fp8", "mxfp4", "none")


@dataclass
class Fp8BlockConfig:
    """`quantization_config: {quant_method: fp8, weight_block_size: [bo, bi], ...}`."""
    block: tuple[int, int] = (128, 128)
    # Module-name substrings left unquantised (`modules_to_not_convert` / `ignored_layers`).
    ignored: list[str] = field(default_factory=list)
    # Not from config.json: the engine's choice (resolve_fp8_experts) to keep the routed experts
    # in FP8 instead of dequantising them at load.
    keep_experts: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "Fp8BlockConfig | None":
        qc = cfg.get("quantization_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method={method!r} is not supported (only 'fp8')")
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("only block-wise FP8 checkpoints (quantization_config.weight_block_size "
                             "= [128, 128]) are supported")
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax's hub names it by torch's dtype
            raise ValueError(f"FP8 format {fmt!r} is not supported (only e4m3)")
        ignored = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
        return cls((int(block[0]), int(block[1])), ignored)

    def skips(self, module_name: str) -> bool:
        return any(pat in module_name for pat in self.ignored)


def resolve_fp8_experts(fp8: Fp8BlockConfig | None, quantization: str | None, device: torch.device,
                        moe_backend: str | None, load_format: str, supported: bool) -> bool:
    """Keep the routed experts FP8? (`supported`: the model class can, `supports_fp8_experts`.)

    quantization=None (auto): yes for a 128x128 block FP8 checkpoint on CUDA with the Triton
    backend available and not overridden (moe_backend None or "triton"); the torch backend would
    dequantise every expert at every step. "fp8": yes wherever it runs (on the CPU or with
    moe_backend="torch" the expert layer dequantises per call: slow, for tests); the checkpoint
    must be block-FP8. "none": never. load_format="dummy" always dequantises (random fp8 weights
    cannot be drawn in place).
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}")
    if quantization == "fp8" and (fp8 is None or not supported):
        raise ValueError("quantization='fp8' needs a block-FP8 checkpoint (config.json quantization_config "
                         "with quant_method 'fp8' and weight_block_size) of a model with FP8 experts "
                         "(DeepseekV3ForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM); online quantisation "
                         "is not supported")
    if fp8 is None or not supported or quantization in ("none", "mxfp4"):
        return False
    if load_format == "dummy":
        logger.info("FP8 checkpoint with load_format='dummy': routed experts use dequantised random weights")
        return False
    if quantization == "fp8":
        return True
    if fp8.block != (128, 128):
        logger.info("FP8 block %s is not 128x128: routed experts are dequantised at load", fp8.block)
        return False
    triton_ok = device.type == "cuda" and "triton" in kernels.available_backends(device)
    if not triton_ok or moe_backend not in (None, "triton"):
        logger.info("FP8 checkpoint: routed experts are dequantised at load (FP8 experts need CUDA and "
                    "the Triton backend; device=%s, moe_backend=%s)", device, moe_backend)
        return False
    logger.info("FP8 checkpoint: routed experts stay FP8 (Triton FP8 kernel); other weights are dequantised")
    return True


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    *lead, out, inp = weight_shape
    return (*lead, math.ceil(out / block[0]), math.ceil(inp / block[1]))


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [..., out, in] (fp8, or any float dtype holding fp8 values exactly), scale_inv
    [..., ceil(out/bo), ceil(in/bi)] -> fp32 [..., out, in], computed on the CPU."""
    w = weight.to("cpu", torch.float32)
    s = scale_inv.to("cpu", torch.float32)
    out, inp = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :out, :inp]
    return w * s


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for tests and tools: weight [..., out, in] -> (float8_e4m3fn weight, fp32
    scale_inv) with each block's absolute max mapped to the e4m3 maximum."""
    w = weight.to(torch.float32)
    out, inp = w.shape[-2:]
    po, pi = -out % block[0], -inp % block[1]
    padded = torch.nn.functional.pad(w, (0, pi, 0, po))
    *lead, O, I = padded.shape
    blocks = padded.reshape(*lead, O // block[0], block[0], I // block[1], block[1])
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = amax / FP8_E4M3_MAX
    expanded = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :out, :inp]
    q = (w / expanded).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class _Pairing:
    """What one quantised parameter's weight and scale loaders share: whichever of a piece's
    two tensors is waiting for the other, always on the CPU."""

    def __init__(self, inner: ParamLoader, block: tuple[int, int]) -> None:
        self.inner, self.block = inner, block
        self.weight_param: torch.Tensor | None = None
        self.waiting_weights: dict = {}
        self.waiting_scales: dict = {}
        self.foreign: set = set()  # pieces held by another rank (their scales need not wait)

    def dequantised_load(self, weight: torch.Tensor, scale: torch.Tensor, key) -> list:
        deq = dequantize_fp8_block(weight, scale, self.block)
        return self.inner.load(self.weight_param, deq, *key)


class Fp8WeightLoader(ParamLoader):
    """Wraps a weight's loader: the checkpoint gives fp8 values, the parameter gets them times
    their block scales."""

    def __init__(self, pairing: _Pairing) -> None:
        self.pairing = pairing

    def pieces(self):
        return self.pairing.inner.pieces()

    def wants(self, shard_id, expert_id):
        return self.pairing.inner.wants(shard_id, expert_id)

    def ckpt_shape(self, shard_id, expert_id):
        return self.pairing.inner.ckpt_shape(shard_id, expert_id)

    def load(self, param, tensor, shard_id, expert_id):
        pr, key = self.pairing, (shard_id, expert_id)
        pr.weight_param = param
        scale = pr.waiting_scales.pop(key, None)
        if scale is not None:
            return pr.dequantised_load(tensor, scale, key)
        # The scale comes later: the raw values go in now (so the pieces are known, e.g. none
        # for an expert of another EP rank) and are rewritten, scaled, when it does.
        filled = pr.inner.load(param, tensor, shard_id, expert_id)
        if filled:
            pr.waiting_weights[key] = tensor.to("cpu")
        else:
            pr.foreign.add(key)
        return filled


class Fp8ScaleLoader(ParamLoader):
    """The `*_scale_inv` companion: same pieces as the weight, block-grid shapes; keeps the
    checkpoint's scales flat in its parameter (piece after piece, at `offsets`)."""

    def __init__(self, pairing: _Pairing) -> None:
        self.pairing = pairing
        self.offsets, total = {}, 0
        for piece in pairing.inner.pieces():
            n = math.prod(self.ckpt_shape(*piece))
            self.offsets[piece] = (total, n)
            total += n
        self.numel = total

    def pieces(self):
        return self.pairing.inner.pieces()

    def wants(self, shard_id, expert_id):
        return self.pairing.inner.wants(shard_id, expert_id)

    def ckpt_shape(self, shard_id, expert_id):
        return scale_shape(self.pairing.inner.ckpt_shape(shard_id, expert_id), self.pairing.block)

    def load(self, param, tensor, shard_id, expert_id):
        pr, key = self.pairing, (shard_id, expert_id)
        if key in self.offsets:
            start, n = self.offsets[key]
            param.data[start:start + n].copy_(tensor.reshape(-1))
        weight = pr.waiting_weights.pop(key, None)
        if weight is not None:
            pr.dequantised_load(weight, tensor, key)
        elif key not in pr.foreign:
            pr.waiting_scales[key] = tensor.to("cpu", torch.float32)
        return [key]


def attach_fp8_scales(model: nn.Module, cfg: Fp8BlockConfig,
                      quantised: Callable[[str, nn.Module], list[str]]) -> None:
    """Give every quantised weight of `model` its scale companion.

    `quantised(module_name, module)` lists the parameter names of a module that the checkpoint
    holds in FP8 (e.g. ["weight"] for a linear, ["w13_weight", "w2_weight"] for experts).
    """
    for mname, module in list(model.named_modules()):
        if cfg.skips(mname):
            continue
        for pname in quantised(mname, module):
            param = getattr(module, pname)
            pairing = _Pairing(param.param_loader, cfg.block)
            scale_loader = Fp8ScaleLoader(pairing)
            attach_loader(param, Fp8WeightLoader(pairing))
            scale = new_param(scale_loader.numel, dtype=torch.float32)
            scale.data.fill_(1.0)
            setattr(module, pname + "_scale_inv", attach_loader(scale, scale_loader))


def experts_fp8_block(fp8: Fp8BlockConfig | None, layer_idx: int) -> tuple[int, int] | None:
    """The scale block when this layer's routed experts stay FP8 (the engine chose so and the
    checkpoint quantised them), else None."""
    if fp8 is None or not fp8.keep_experts or fp8.skips(f"model.layers.{layer_idx}.mlp.experts"):
        return None
    return fp8.block


def block_fp8_params(module_name: str, module: nn.Module) -> list[str]:
    """attach_fp8_scales' choice for DeepSeek-style hub checkpoints: the weights stored in FP8 and
    dequantised at load are every linear's and the routed experts' unless they stay FP8 and own
    their scales (not the embedding, lm_head, norms or router gate)."""
    from models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    from models.layers.moe import FusedMoE

    if isinstance(module, FusedMoE):
        return [] if module.fp8_block is not None else ["w13_weight", "w2_weight"]
    if isinstance(module, (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)):
        return ["weight"]
    return []
