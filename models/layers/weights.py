"""How a parameter takes its tensors from a checkpoint.

A checkpoint tensor lands in a parameter as a *piece*: (shard_id, expert_id), e.g. the "k"
shard of a fused qkv weight, or expert 3's "w1". Each parameter carries a `ParamLoader` that
lists the pieces it needs, the checkpoint shape each must have, and copies (slicing for
tensor parallelism) — so the generic loader can report a missing, unexpected or mis-shaped
tensor by name without knowing any layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

Piece = tuple[Hashable, Hashable]  # (shard_id, expert_id); None where not applicable


class ParamLoader:
    def pieces(self) -> list[Piece]:
        return [(None, None)]

    def wants(self, shard_id, expert_id) -> bool:
        """False when this rank keeps nothing of that checkpoint tensor (e.g. another expert-
        parallel rank's expert): the loader then skips reading it from disk."""
        return True

    def ckpt_shape(self, shard_id, expert_id) -> tuple[int, ...]:
        raise NotImplementedError

    def stored_dtype(self, shard_id) -> torch.dtype | None:
        """The dtype a piece must have on disk where the loader takes it as stored (MXFP4's uint8
        blocks and scales, which it dequantises itself); None: it arrives in the parameter's dtype."""
        return None

    def load(self, param: torch.Tensor, tensor: torch.Tensor, shard_id, expert_id) -> list[Piece]:
        """Copy `tensor` (already shape-checked) into `param`; return the pieces it filled."""
        raise NotImplementedError


class ReplicatedLoader(ParamLoader):
    """The checkpoint tensor is the parameter, whole."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = tuple(shape)

    def ckpt_shape(self, shard_id, expert_id):
        return self.shape

    def load(self, param, tensor, shard_id, expert_id):
        param.data.copy_(tensor)
        return [(shard_id, expert_id)]


@dataclass
class Shard:
    """Where one checkpoint tensor (full size `full` along `dim`) goes in the parameter:
    `size` elements starting at `ckpt_start` in the checkpoint, to `param_offset` in the param."""
    full: int
    ckpt_start: int
    size: int
    param_offset: int


class ShardedLoader(ParamLoader):
    """Tensor-parallel slicing along one dimension, for one or several fused shards."""

    def __init__(self, param_shape: tuple[int, ...], dim: int, shards: dict) -> None:
        self.param_shape = tuple(param_shape)
        self.dim = dim
        self.shards: dict = shards

    def pieces(self):
        return [(s, None) for s in self.shards]

    def ckpt_shape(self, shard_id, expert_id):
        shape = list(self.param_shape)
        shape[self.dim] = self.shards[shard_id].full
        return tuple(shape)

    def load(self, param, tensor, shard_id, expert_id):
        s = self.shards[shard_id]
        src = tensor.narrow(self.dim, s.ckpt_start, s.size)
        param.data.narrow(self.dim, s.param_offset, s.size).copy_(src)
        return [(shard_id, expert_id)]


def attach_loader(param: torch.nn.Parameter, loader: ParamLoader) -> torch.nn.Parameter:
    param.param_loader = loader
    return param


def new_param(*shape: int, dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """An uninitialised parameter on the current default device/dtype (weights come from disk)."""
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
