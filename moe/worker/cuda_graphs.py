"""CUDA graphs of whole forwards, captured at start-up and replayed, so a step costs a few launches
instead of thousands.

Decode-only steps: one graph per batch size. A step of B sequences replays the graph of the
smallest captured size b >= B; rows B..b are padding (slot -1: no KV write; seq_len 0: attention
reads nothing) and their outputs are dropped.
Mixed steps (prefill chunks, with or without decodes): one graph per token count, each over
max_num_seqs + 1 sequences. A step of T tokens replays the graph of the smallest captured count
t >= T; its padding tokens form sequences of context 0 after the real ones (attention writes
zeros for them). Only where every attention launch reads its layout from device tensors alone
(the unified kernel of models/layers/attention.py; MLA, every row absorbed, for steps of up to
2048 tokens whose chunks hold little attention, MLAAttention.mixed_graph_fits: other steps run
eagerly), and not under expert parallelism.
The graphs read their inputs from the runner's StepBuffers, so a replay needs only the upload
that every step does anyway. On one rank (no tensor parallelism) they end with the LM head over the
step's sample rows, into one logits buffer all of them write (ModelRunner._with_logits): the
sampler reads it after the replay.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Callable

import torch

logger = logging.getLogger("moe.worker.cuda_graphs")


MIXED_GRAPHS = os.environ.get("MOE_MIXED_GRAPHS", "1") != "0"  # 0: mixed steps run eagerly (A/B runs)
# 0: the LM head runs eagerly after a replay, not inside the graphs (A/B runs)
GRAPH_LOGITS = os.environ.get("MOE_GRAPH_LOGITS", "1") != "0"
# 0: the coarser mixed-step token counts (default_mixed_sizes(fine=False); A/B runs)
FINE_MIXED_SIZES = os.environ.get("MOE_FINE_MIXED_SIZES", "1") != "0"


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's shape: 1, 2, 4, then every multiple of 8, up to max_num_seqs (which is added)."""
    sizes = [s for s in [1, 2, 4] + list(range(8, max_num_seqs + 1, 8)) if s <= max_num_seqs]
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


def default_mixed_sizes(max_num_batched_tokens: int, fine: bool | None = None) -> list[int]:
    """Token counts of the mixed-step graphs, up to the step budget (which is added): 64, 128, 256,
    512, then every 256 up to 4096 and every 512 above, so that padding adds at most 255 tokens to a
    step of up to 4096, where the expert GEMMs turn compute-bound and every padding token costs.
    fine=False: powers of two to 512, then every 512 (the eager steps' warm-up needs no more);
    None: FINE_MIXED_SIZES."""
    fine = FINE_MIXED_SIZES if fine is None else fine
    steps = list(range(768, 4097, 256)) + list(range(4608, max_num_batched_tokens + 1, 512)) if fine \
        else list(range(1024, max_num_batched_tokens + 1, 512))
    sizes = [s for s in [64, 128, 256, 512] + steps if s <= max_num_batched_tokens]
    if max_num_batched_tokens not in sizes:
        sizes.append(max_num_batched_tokens)
    return sizes


class StepGraphs:
    """Captured forwards by padded size (sequences of a decode step, or tokens of a mixed one)."""

    def __init__(self, sizes: list[int]) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"cudagraph_capture_sizes must be positive sizes, got {sizes}")
        self.sizes = sorted(set(sizes))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, n: int) -> int | None:
        """The captured size a step of size n replays, or None (run it eagerly)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) and self.graphs else None

    def capture(self, prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor],
                device: torch.device, what: str, pool=None):
        """prepare(b) uploads a padding-only step of size b (outside the capture: host work);
        forward(b) runs the model on it and returns its output tensor. Largest first, all sharing
        one memory pool (smaller graphs reuse the larger's blocks; steps replay one at a time, in
        stream order). Returns the pool, for the next set of graphs to share."""
        torch.cuda.synchronize(device)
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
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
        logger.info("Captured %d CUDA graphs for %s %d..%d in %.1f s, %.2f GiB", len(self.sizes), what,
                    self.sizes[0], self.max_size, time.perf_counter() - start, used / 2**30)
        return pool

    def replay(self, b: int) -> torch.Tensor:
        self.graphs[b].replay()
        return self.outputs[b]
