"""Linear layers, plain and tensor-parallel (column = output dim split, row = input dim split).

Weights are [out, in] as in Hugging Face checkpoints; each rank loads only its slice.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kernels import batch_invariant
from kernels.triton_fused import fused_kernels_serve
from models.layers.weights import ReplicatedLoader, Shard, ShardedLoader, attach_loader, new_param
from models.parallel.state import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce

# MOE_SKINNY_GEMM=0 keeps cuBLAS everywhere (for A/B runs).
_SKINNY = os.environ.get("MOE_SKINNY_GEMM", "1") != "0"


def skinny_wins(M: int, N: int) -> bool:
    """Where the skinny Triton GEMM (kernels/triton_fused/skinny_gemm.py) measured faster than
    cuBLAS on an H200 in CUDA-graph replay (BENCHMARKS.md §4; Qwen3-30B-A3B's projections at TP 1
    and 2): 1 or 2 rows, and up to 4 rows of a narrow output (the router). Elsewhere cuBLAS wins."""
    return M <= 2 or (M <= 4 and N <= 256)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on CUDA with Triton, the skinny GEMM for the decode batch sizes where it wins;
    in batch-invariant mode the fixed-tile GEMM (kernels/batch_invariant.py)."""
    if batch_invariant.enabled():
        return batch_invariant.linear(x, weight, bias)
    if _SKINNY and x.is_cuda and x.dim() == 2 and skinny_wins(x.shape[0], weight.shape[0]) and fused_kernels_serve(x):
        from kernels.triton_fused.skinny_gemm import skinny_linear
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = attach_loader(new_param(out_features, in_features), ReplicatedLoader((out_features, in_features)))
        self.bias = attach_loader(new_param(out_features), ReplicatedLoader((out_features,))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split across TP ranks; several checkpoint tensors may be fused along
    the output dim (`output_sizes`, with their shard ids)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 shard_ids: list | None = None, gather_output: bool = False) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.tp_size, self.gather_output = ps.tp_size, gather_output
        shard_ids = shard_ids if shard_ids is not None else (list(range(len(output_sizes)))
                                                             if len(output_sizes) > 1 else [None])
        shards, offset = {}, 0
        for sid, full in zip(shard_ids, output_sizes):
            size = _divide(full, ps.tp_size, "output size of a column-parallel linear")
            shards[sid] = Shard(full, ps.tp_rank * size, size, offset)
            offset += size
        self._init_params(in_features, offset, shards, bias)

    def _init_params(self, in_features: int, out_local: int, shards: dict, bias: bool) -> None:
        self.weight = attach_loader(new_param(out_local, in_features),
                                    ShardedLoader((out_local, in_features), 0, shards))
        self.bias = attach_loader(new_param(out_local), ShardedLoader((out_local,), 0, shards)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return tp_all_gather_last_dim(y) if self.gather_output else y


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. Heads split across ranks; when there are fewer KV heads than
    ranks, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        nn.Module.__init__(self)
        ps = get_parallel_state()
        self.tp_size, self.gather_output = ps.tp_size, False
        self.num_heads = _divide(num_heads, ps.tp_size, "num_attention_heads")
        if num_kv_heads >= ps.tp_size:
            self.num_kv_heads = _divide(num_kv_heads, ps.tp_size, "num_key_value_heads")
            kv_index = ps.tp_rank
        else:
            if ps.tp_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size={ps.tp_size} must be a multiple of "
                                 f"num_key_value_heads={num_kv_heads} when it exceeds it")
            self.num_kv_heads = 1
            kv_index = ps.tp_rank // (ps.tp_size // num_kv_heads)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        shards = {
            "q": Shard(num_heads * head_dim, ps.tp_rank * q, q, 0),
            "k": Shard(num_kv_heads * head_dim, kv_index * kv, kv, q),
            "v": Shard(num_kv_heads * head_dim, kv_index * kv, kv, q + kv),
        }
        self.q_size, self.kv_size = q, kv
        self._init_params(hidden_size, q + 2 * kv, shards, bias)


class RowParallelLinear(nn.Module):
    """Input features split across TP ranks; partial outputs are summed over the TP group."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        ps = get_parallel_state()
        self.tp_size, self.tp_rank, self.reduce_results = ps.tp_size, ps.tp_rank, reduce_results
        in_local = _divide(in_features, ps.tp_size, "input size of a row-parallel linear")
        shards = {None: Shard(in_features, ps.tp_rank * in_local, in_local, 0)}
        self.weight = attach_loader(new_param(out_features, in_local),
                                    ShardedLoader((out_features, in_local), 1, shards))
        self.bias = attach_loader(new_param(out_features), ReplicatedLoader((out_features,))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        if self.reduce_results:
            y = tp_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
