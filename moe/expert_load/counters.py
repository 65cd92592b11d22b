"""The device side of expert-load recording: resident counters every MoE layer adds into.

Legend: L MoE layers of this rank (its pipeline stage), E logical experts, P physical experts
(E plus EPLB's redundant replicas; P == E without EPLB).

Counting happens inside the forward (kernels/expert_count.py): no host synchronisation, and it
is captured into the decode CUDA graphs like any other kernel. The runner tells the counters how
many rows of each step are real (`set_num_valid`): rows past that (a CUDA graph's padding) and
whole dummy batches (num_valid 0) are not counted. What start-up runs (the memory-profiling
forward, graph warm-ups; num_valid is still 0 then) is also left out by the engine core, whose
windows start from a snapshot taken after start-up: the counters only ever grow, and readers
take differences.

Who counts, so that each token counts once over the ranks: with expert parallelism every rank
counts the rows it dispatches (its tensor-parallel slice of its replica's batch); without it the
tensor-parallel ranks of a replica hold the same rows and only TP rank 0 counts. Each DP replica
counts its own tokens; the engine sums over ranks and matches pipeline stages by layer index.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from kernels.expert_count import count_experts, count_layers, map_to_physical_and_count
from models.layers.moe import FusedMoE

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertLoadCounters:
    """logical_LE and physical_LP int64 on the model's device; row i belongs to decoder layer
    layers[i]. Without EPLB (`replicated` False) a physical expert is its logical one and the
    two names are one tensor, counted once."""

    def __init__(self, layers: list[int], num_logical: int, num_physical: int, device: torch.device,
                 replicated: bool = False) -> None:
        self.layers = list(layers)
        self.logical_LE = torch.zeros(len(layers), num_logical, dtype=torch.int64, device=device)
        self.physical_LP = torch.zeros(len(layers), num_physical, dtype=torch.int64, device=device) \
            if replicated else self.logical_LE
        self.num_valid = torch.zeros(1, dtype=torch.int64, device=device)
        # The step buffer of routed ids [L, max_tokens, K]: a router that writes its ids there
        # (softmax_topk) leaves the counting to one launch for all layers after the forward
        # (count_pending) instead of one per layer. Sized by `reserve` (the engine's token
        # budget) before any CUDA graph captures views of it.
        self.max_tokens = 0
        self.ids_LTK: torch.Tensor | None = None
        self._pending: tuple[int, int] | None = None  # (T, rows written) of the forward in flight

    def reserve(self, max_tokens: int) -> None:
        """The most rows a forward may have (the step buffer is made at the first routing)."""
        if max_tokens > self.max_tokens:
            self.max_tokens, self.ids_LTK = max_tokens, None

    def ids_out(self, row: int, T: int, K: int) -> torch.Tensor | None:
        """Where layer `row` writes its [T, K] routed ids to be counted after the forward; None
        (count in the layer) for a forward larger than reserved."""
        if T > self.max_tokens:
            return None
        if self.ids_LTK is None or self.ids_LTK.shape[2] != K:
            self.ids_LTK = torch.zeros(len(self.layers), self.max_tokens, K, dtype=torch.int32,
                                       device=self.logical_LE.device)
        written = self._pending[1] + 1 if self._pending is not None else 1
        self._pending = (T, written)
        return self.ids_LTK[row, :T]

    def count_pending(self) -> None:
        """After a forward: count the ids the layers wrote into the step buffer, one launch."""
        if self._pending is None:
            return
        T, written = self._pending
        self._pending = None
        if written != len(self.layers):
            raise RuntimeError(f"{written} of {len(self.layers)} MoE layers wrote routed ids this forward: "
                               "the step buffer is counted for all layers or none")
        count_layers(self.ids_LTK[:, :T], self.logical_LE, self.num_valid)

    def set_num_valid(self, n: int) -> None:
        """Rows of the coming forward that are real tokens (0 for a dummy batch)."""
        self.num_valid.fill_(n)

    def record(self, row: int, ids_TK: torch.Tensor, row_offset: int = 0, rows_per_token: int = 1) -> None:
        """Count a layer's routed slots when logical == physical (no EPLB replicas)."""
        count_experts(ids_TK, self.logical_LE[row], self.num_valid, row_offset, rows_per_token)

    def map_and_record(self, row: int, ids_TK: torch.Tensor, log_to_phys_ER: torch.Tensor,
                       replica_count_E: torch.Tensor, row_offset: int = 0, rows_per_token: int = 1) -> torch.Tensor:
        """EPLB: the physical ids of a layer's routed slots, counting logical and physical load."""
        return map_to_physical_and_count(ids_TK, log_to_phys_ER, replica_count_E, self.logical_LE[row],
                                         self.physical_LP[row], self.num_valid, row_offset, rows_per_token)

    def snapshot(self) -> dict:
        """Cumulative counts as numpy (a device -> host copy: call between steps)."""
        # copy=True: on the CPU .cpu() would hand out the live buffer itself
        return {"layers": list(self.layers), "logical": self.logical_LE.to("cpu", copy=True).numpy(),
                "physical": self.physical_LP.to("cpu", copy=True).numpy()}


def moe_layer_index(module_name: str) -> int:
    """The decoder-layer index in a module name like 'model.layers.7.mlp.experts'."""
    m = _LAYER_INDEX.search(module_name + ".")
    if m is None:
        raise ValueError(f"cannot tell the decoder layer of MoE module {module_name!r}")
    return int(m.group(1))


def attach_expert_counters(model: torch.nn.Module, device: torch.device,
                           counts_here: bool) -> ExpertLoadCounters | None:
    """Give every routed-expert module (FusedMoE) of `model` its row of one ExpertLoadCounters.

    counts_here: whether this rank counts at all without expert parallelism (TP rank 0 only);
    ranks of an expert-parallel layout always count their own slice. None when the model has no
    MoE layer."""
    experts = [(moe_layer_index(name), m) for name, m in model.named_modules() if isinstance(m, FusedMoE)]
    if not experts:
        return None
    experts.sort(key=lambda item: item[0])
    first = experts[0][1]
    counters = ExpertLoadCounters([i for i, _ in experts], first.num_experts, first.num_physical_experts, device,
                                  replicated=first.eplb is not None)
    for row, (_, m) in enumerate(experts):
        m.attach_load_counters(counters, row, enabled=m.use_ep or counts_here)
    return counters


def sum_snapshots(snapshots: list[dict]) -> dict:
    """One snapshot over ranks: rows matched by decoder-layer index, counts summed."""
    layers = sorted({layer for s in snapshots for layer in s["layers"]})
    at = {layer: i for i, layer in enumerate(layers)}
    E = snapshots[0]["logical"].shape[1]
    P = snapshots[0]["physical"].shape[1]
    logical, physical = np.zeros((len(layers), E), np.int64), np.zeros((len(layers), P), np.int64)
    for s in snapshots:
        rows = [at[layer] for layer in s["layers"]]
        logical[rows] += s["logical"]
        physical[rows] += s["physical"]
    return {"layers": layers, "logical": logical, "physical": physical}
