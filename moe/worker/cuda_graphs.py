"""CUDA graphs for decode-only steps: the model forward captured once per batch size at start-up
and replayed, so a decode step costs a few launches instead of thousands.

A decode step of B sequences replays the graph of the smallest captured size b >= B; rows B..b
are padding (slot -1: no KV write; seq_len 0: attention reads nothing) and their outputs are
dropped. The graphs read their inputs from the runner's StepBuffers, so a replay needs only the
upload that every step does anyway.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

logger = logging.getLogger("moe.worker.cuda_graphs")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's shape: 1, 2, 4, then every multiple of 8, up to max_num_seqs (which is added)."""
    sizes = [s for s in [1, 2, 4] + list(range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode forwards by padded batch size."""

    def __init__(self, sizes: list[int]) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cudagraph_capture_sizes must be positive batch sizes, got {sizes}")
        self.sizes = sorted(set(sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode step of num_seqs replays, or None (run it eagerly)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) and self.graphs else None

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                device: torch.device) -> None:
        """prepare(b) uploads b padding decode rows (outside the capture: host work); forward(b)
        runs the model on them and returns its output tensor. Largest first, all sharing one
        memory pool (smaller graphs reuse the larger's blocks)."""
        torch.cuda.synchronize(device)
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            prepare(b)
            forward(b)  # warm-up: compiles this size's kernels, initialises collectives
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("Captured %d CUDA graphs for decode batch sizes %d..%d in %.1f s, %.2f GiB",
                    len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - start, used / 2**30)

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        return self.outputs[b]
