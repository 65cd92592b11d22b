"""The SwiGLU MLP every family uses (dense layers and shared experts): fused gate/up
(column-parallel), SiLU(gate) * up, row-parallel down.

Parameter names are `gate_up_proj` (shards 0 = gate, 1 = up) and `down_proj`; each model maps
its checkpoint names onto them with NameRules (`gate_proj` -> gate_up_proj shard 0, ...).

Legend: T tokens, D hidden, F intermediate (F/tp on each TP rank).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import batch_invariant
from models.layers.linear import ColumnParallelLinear, RowParallelLinear


class SwiGLUMLP(nn.Module):
    """x [T, D] -> down(silu(gate(x)) * up(x)) [T, D].

    bias: biases on gate/up (TP-sliced) and down (replicated, added after the reduction).
    reduce_results: False leaves the down projection's partial sums un-reduced over the TP
    group, for a caller that sums them with other partial results before one all-reduce.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("SwiGLUMLP: a down-projection bias needs reduce_results=True (it is added once, "
                             "after the TP reduction)")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TF, up_TF = self.gate_up_proj(x_TD).chunk(2, dim=-1)
        return self.down_proj(batch_invariant.pointwise(F.silu, gate_TF) * up_TF)
