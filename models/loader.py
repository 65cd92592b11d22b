"""Weight loading from Hugging Face safetensors checkpoints (one file or index-mapped shards).

Checkpoint names map to parameters through a model's declared `NameRule`s (substring pairs,
`{e}` standing for an expert id); each parameter's `ParamLoader` slices and copies. Every
mismatch is reported by checkpoint tensor name: missing, unexpected, or mis-shaped.

FP8 checkpoints may carry per-tensor KV-cache scales per attention layer; they are not parameters
but the attention layer's `k_scale` / `v_scale` floats (see `kv_scale_target`), which an FP8 KV
cache (kv_cache_dtype="fp8") quantises with and any other cache ignores, as vLLM does.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Hashable, Iterator
import zlib

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

logger = logging.getLogger("moe.loader")


@dataclass(frozen=True)
class NameRule:
    """`ckpt` (in checkpoint names) <-> `param` (in parameter names), filling piece `shard`.

    `{e}` in `ckpt` captures an expert id. Matches whole dotted components only.
    """
    param: str
    ckpt: str
    shard: Hashable = None

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.ckpt

    def pattern(self) -> re.Pattern:
        body = re.escape(self.ckpt).replace(re.escape("{e}"), r"(\d+)")
        return re.compile(r"(?:^|(?<=\.))" + body + r"(?=\.|$)")


# Hugging Face's separate projections -> our fused column-parallel layers (every family).
QKV_RULES = [NameRule("qkv_proj", "q_proj", "q"), NameRule("qkv_proj", "k_proj", "k"),
             NameRule("qkv_proj", "v_proj", "v")]
GATE_UP_RULES = [NameRule("gate_up_proj", "gate_proj", 0), NameRule("gate_up_proj", "up_proj", 1)]
# The hub's per-expert SwiGLU names (experts.{e}.gate_proj / up_proj / down_proj, with the FP8 block
# scales beside them first: their names extend the weights') and transformers' fused 3-D tensors.
EXPERT_RULES = [rule for suffix in ("_scale_inv", "") for rule in (
    NameRule(f"experts.w13_weight{suffix}", f"experts.{{e}}.gate_proj.weight{suffix}", "w1"),
    NameRule(f"experts.w13_weight{suffix}", f"experts.{{e}}.up_proj.weight{suffix}", "w3"),
    NameRule(f"experts.w2_weight{suffix}", f"experts.{{e}}.down_proj.weight{suffix}", "w2"),
)] + [NameRule("experts.w13_weight", "experts.gate_up_proj", "w13"),
      NameRule("experts.w2_weight", "experts.down_proj", "w2")]


def map_checkpoint_name(name: str, rules: list[NameRule]) -> tuple[str, Hashable, int | None]:
    """Checkpoint tensor name -> (parameter name, shard id, expert id)."""
    for rule in rules:
        m = rule.pattern().search(name)
        if m:
            expert = int(m.group(1)) if rule.per_expert else None
            return name[:m.start()] + rule.param + name[m.end():], rule.shard, expert
    return name, None, None


def checkpoint_name_for(param_name: str, shard: Hashable, expert: int | None, rules: list[NameRule]) -> str:
    """The checkpoint name that would fill one piece of a parameter (for error messages)."""
    for rule in rules:
        if rule.shard == shard and rule.per_expert == (expert is not None) and rule.param in param_name:
            return param_name.replace(rule.param, rule.ckpt.format(e=expert), 1)
    return param_name


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise OSError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise OSError(f"{model_dir!r} has no *.safetensors weights (use load_format='dummy' for random weights)")
    return [os.path.join(model_dir, f) for f in files]


class CheckpointFileError(ValueError):
    """A safetensors file that cannot be read (truncated, corrupt), named by its path."""


def _open_safetensors(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type, without the file's name
        raise CheckpointFileError(f"cannot read the safetensors file {path} ({e}): is it truncated or "
                                  "corrupt? Download it again") from None


def read_tensor(path: str, f, name: str) -> torch.Tensor:
    """One tensor's data; a read error names the file and the tensor."""
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise CheckpointFileError(f"cannot read tensor {name!r} of the safetensors file {path} ({e}): is the "
                                  "file truncated or corrupt? Download it again") from None


def iterate_checkpoint(model_dir: str, progress: bool = True) -> Iterator[tuple[str, str, "safe_open"]]:
    """Yields (file, tensor name, open handle) over every tensor of every shard."""
    files = checkpoint_files(model_dir)
    for path in tqdm(files, desc="Loading safetensors checkpoint shards", disable=not progress or len(files) < 2):
        with _open_safetensors(path) as f:
            for name in f.keys():
                yield path, name, f


# The names quantisation tools give KV-cache scales (vLLM reads the same ones): self_attn.k_scale /
# v_scale, self_attn.{k,v}_proj.{k,v}_scale, self_attn.{k,v}_proj.output_scale, the older
# self_attn.kv_scale (one for both), also under self_attn.attn. / mla_attn.; q_scale and prob_scale
# (FP8 attention maths, not done here) are read past.
_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.|mla_attn\.)?(?:([qkv])_proj\.)?"
                       r"(q_scale|k_scale|v_scale|kv_scale|prob_scale|output_scale)$")
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def kv_scale_target(name: str) -> tuple[int, tuple[str, ...]] | None:
    """A KV-cache scale's (layer index, attributes it sets: "k_scale" / "v_scale", none for scales
    that are read past), or None when `name` is no such scale."""
    m = _KV_SCALE.search(name)
    if m is None:
        return None
    layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
    if kind == "output_scale":  # a projection's output: which one says what it scales
        if proj is None:
            return None
        kind = {"k": "k_scale", "v": "v_scale"}.get(proj, "q_scale")
    if kind == "kv_scale":
        return layer, ("k_scale", "v_scale")
    return layer, (kind,) if kind in ("k_scale", "v_scale") else ()


def _attention_layers_by_index(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """This rank's attention layers (of this pipeline stage) by decoder-layer index."""
    layers = getattr(model, "attention_layers", None)
    if layers is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for attn in layers():
        found = _LAYER_INDEX.findall(names.get(id(attn), ""))
        if found:
            out[int(found[-1])] = attn
    return out


def _load_kv_scale(attn_by_layer: dict, where: str, read, name: str, target) -> None:
    layer, attrs = target
    attn = attn_by_layer.get(layer)
    if attn is None or not attrs:  # another pipeline stage's layer, or a scale not used here
        return
    tensor = read()
    if tensor.numel() != 1 or not tensor.is_floating_point():
        raise ValueError(f"tensor {name!r} in {where} has shape {_fmt(tensor.shape)} "
                         f"({tensor.dtype}): only one floating-point KV-cache scale per tensor is supported")
    value = float(tensor.float().item())
    if not value > 0:
        raise ValueError(f"KV-cache scale {name!r} in {where} is {value}: it must be positive")
    for attr in attrs:
        setattr(attn, attr, value)


def _fmt(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def load_weights(model: torch.nn.Module, model_dir: str, progress: bool = True) -> None:
    """Fill every parameter of `model` from the checkpoint, or raise naming what is wrong."""
    def tensors():
        for path, name, f in iterate_checkpoint(model_dir, progress):
            # the header's shape first: no data read for a tensor of the wrong shape or of another rank
            yield (os.path.basename(path), name, lambda f=f, name=name: tuple(f.get_slice(name).get_shape()),
                   lambda path=path, f=f, name=name: read_tensor(path, f, name))

    loaded = _load_tensors(model, tensors())
    _check_complete(model, loaded, f"checkpoint in {model_dir!r}")


@torch.no_grad()
def update_weights(model: torch.nn.Module, named_tensors) -> int:
    """Copy (Hugging Face name, tensor) pairs into `model`'s parameters in place, through the same
    name rules, shape checks and tensor-/expert-parallel slicing as a checkpoint load (any subset of
    the checkpoint's tensors). Returns how many pieces this rank took."""
    def tensors():
        for name, tensor in named_tensors:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"update_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            t = tensor.detach().cpu()
            yield "update_weights", name, lambda t=t: tuple(t.shape), lambda t=t: t

    return sum(len(pieces) for pieces in _load_tensors(model, tensors()).values())


def _load_tensors(model: torch.nn.Module, tensors) -> dict[str, set]:
    """Load (where, name, shape(), read()) items; returns the (shard, expert) pieces loaded per parameter."""
    rules: list[NameRule] = model.weight_name_rules()
    params = dict(model.named_parameters())
    loaded: dict[str, set] = defaultdict(set)
    attn_by_layer = None
    for where, name, shape_of, read in tensors:
        if model.ignore_checkpoint_name(name):
            continue
        target = kv_scale_target(name)
        if target is not None and name not in params:
            if attn_by_layer is None:
                attn_by_layer = _attention_layers_by_index(model)
            _load_kv_scale(attn_by_layer, where, read, name, target)
            continue
        pname, shard, expert = map_checkpoint_name(name, rules)
        param = params.get(pname)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} in {where}: the "
                             f"{type(model).__name__} model has no parameter for it")
        num_experts = getattr(param.param_loader, "E", None)  # expert loaders know the global count
        if expert is not None and num_experts is not None and expert >= num_experts:
            raise ValueError(f"unexpected tensor {name!r} in {where}: expert {expert} is beyond "
                             f"the model's {num_experts} experts (config.json says {num_experts})")
        want = param.param_loader.ckpt_shape(shard, expert)
        shape = shape_of()
        if shape != tuple(want):
            raise ValueError(f"tensor {name!r} in {where} has shape {_fmt(shape)}, "
                             f"but the model expects {_fmt(want)}")
        if not param.param_loader.wants(shard, expert):
            continue
        tensor = read()
        stored = param.param_loader.stored_dtype(shard)
        if stored is not None:
            if tensor.dtype != stored:
                raise ValueError(f"tensor {name!r} in {where} has dtype {tensor.dtype}, but the "
                                 f"model expects {stored}")
        elif param.is_floating_point() and not tensor.is_floating_point():
            raise ValueError(f"tensor {name!r} in {where} has dtype {tensor.dtype}, but the "
                             f"model expects floating-point weights ({param.dtype}); integer-quantised "
                             "checkpoints are not supported")
        else:
            tensor = tensor.to(param.dtype)
        loaded[pname].update(param.param_loader.load(param, tensor, shard, expert))
    return loaded


def _check_complete(model: torch.nn.Module, loaded: dict[str, set], what: str) -> None:
    rules: list[NameRule] = model.weight_name_rules()
    missing = []
    for pname, param in model.named_parameters():
        for shard, expert in param.param_loader.pieces():
            if (shard, expert) not in loaded[pname]:
                missing.append(checkpoint_name_for(pname, shard, expert, rules))
    if missing:
        shown = ", ".join(repr(m) for m in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{what} is missing tensor(s) {shown}{more}")


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, low: float = -1e-3, high: float = 1e-3) -> None:
    """Random weights at the real size (load_format='dummy', for benchmarks).

    Biases are zeroed: the same for every token, a random one (a router's, DeepSeek-V3's correction
    bias, or gpt-oss's attention and expert biases in the residual stream) would outweigh the
    near-zero, token-dependent values of random weights and send every token to the same experts.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            if getattr(param, "dummy_range", None) is not None:  # packed codes (MXFP4): random in range
                lo, hi = param.dummy_range
                param.data.random_(lo, hi + 1)
            continue
        if name.endswith("bias"):
            param.data.zero_()
        elif param.device.type == "cpu":
            param.data.copy_(torch.empty(param.shape, dtype=torch.float32).uniform_(low, high, generator=gen))
        else:  # fill on the device: copying GBs of random numbers from the host is slow
            param.data.uniform_(low, high)
    for name, module in model.named_modules():
        if getattr(module, "eplb", None) is not None:  # EPLB replicas of one expert must be equal
            module.fill_dummy_replicas(seed ^ zlib.crc32(name.encode()), low, high)
