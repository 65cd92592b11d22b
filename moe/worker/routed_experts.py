"""The worker side of returned routed experts (enable_return_routed_experts): the logical expert
ids each MoE layer's router chose for every token of a step, captured on the device.

Every MoE block writes its router's [T, K] ids into row `row` of one step buffer [max_tokens, L, K]
int16 (L = the MoE layers of this rank's pipeline stage) inside the forward: a copy per layer,
captured into the CUDA graphs like any other kernel, before any EPLB replica mapping (what the
router chose, not where it ran). After the forward the runner copies the step's [T, L, K] rows to
pinned host memory together with the sampled tokens, so reading them costs no extra sync.

Who reports: the routing is computed on every rank for all the step's rows of its replica (tensor
and expert parallelism split the rows only after it), so TP rank 0 of each pipeline stage reports
its stage's layers; the executor joins the stages' layers (`merge_stage_routing`).
"""
from __future__ import annotations

import numpy as np
import torch

from models.layers.moe import MoEBlock
from moe.expert_load.counters import moe_layer_index


class RoutedExpertsCapture:
    """The step buffer ids_TLK and the decoder-layer index of each of its L rows."""

    def __init__(self, layers: list[int], device: torch.device) -> None:
        self.layers = list(layers)
        self.device = device
        self.max_tokens = 0
        self.ids_TLK: torch.Tensor | None = None  # made at the first routing (K from the router)

    def reserve(self, max_tokens: int) -> None:
        """The most rows a forward has (before any CUDA graph captures a view of the buffer)."""
        if max_tokens > self.max_tokens:
            self.max_tokens, self.ids_TLK = max_tokens, None

    def write(self, row: int, ids_TK: torch.Tensor) -> None:
        """Layer `row`'s routed ids of this forward. An eager forward larger than reserved grows the
        buffer (a graph's forward never is: its sizes are within the reserve)."""
        T, K = ids_TK.shape
        buf = self.ids_TLK
        if buf is None or T > buf.shape[0] or buf.shape[2] != K:
            self.max_tokens = max(self.max_tokens, T)
            buf = self.ids_TLK = torch.zeros(self.max_tokens, len(self.layers), K, dtype=torch.int16,
                                             device=self.device)
        buf[:T, row].copy_(ids_TK)

    def step_rows(self, T: int) -> torch.Tensor | None:
        """The [T, L, K] rows of the forward just run (a view: copy before the next forward)."""
        return None if self.ids_TLK is None else self.ids_TLK[:T]


def attach_routed_capture(model: torch.nn.Module, device: torch.device) -> RoutedExpertsCapture | None:
    """Give every MoE block of `model` its row of one capture buffer; None without MoE layers."""
    blocks = sorted(((moe_layer_index(name), m) for name, m in model.named_modules() if isinstance(m, MoEBlock)),
                    key=lambda item: item[0])
    if not blocks:
        return None
    capture = RoutedExpertsCapture([i for i, _ in blocks], device)
    for row, (_, block) in enumerate(blocks):
        block.routed_capture, block.routed_row = capture, row
    return capture


def merge_stage_routing(parts: list[tuple[np.ndarray, list[int]]]) -> tuple[np.ndarray, list[int]]:
    """One step's [T, L, K] routing from the pipeline stages' (rows, decoder-layer indices), layers
    in model order."""
    parts = sorted(parts, key=lambda p: p[1][0])
    return np.concatenate([p[0] for p in parts], axis=1), [layer for p in parts for layer in p[1]]
