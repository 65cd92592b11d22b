"""Pinned host and device buffers for one step's integer inputs, allocated once at the largest
step and reused: each step writes numpy views of the host side, then ONE asynchronous copy moves
the span that holds every used prefix to the device (issuing a copy costs the host the same
whatever its size, and the span is a few hundred KB at most). CUDA graphs capture views of the
same device buffers, so a replay reads whatever the last upload put there.

Inputs (all int64), the per-step and per-sequence ones first so that the span stays short: num_valid [1]
(the expert-load counters' count of real rows, moe/expert_load/counters.py, when they read it here), query_start_loc
[B+1], seq_lens [B], sample_idx [B] (the token row of each sequence that samples), sample_rows [B]
(the runner row of each sequence that samples: where its token goes in the runner's last-sampled
tokens), then input_ids [T], pending_src [T] (async scheduling: the runner row whose last sampled
token is this token's id, which the host does not know yet; -1 where input_ids holds it),
positions [T] and, per KV-cache group g, slots{g} [T]. Block tables live apart, one device tensor [max_seqs, M] per
group (M = the most blocks a sequence can have, so a CUDA graph's view keeps its shape whatever
the step's longest sequence); a step copies only its [B, m] corner (m = its longest table).
"""
from __future__ import annotations

import numpy as np
import torch


class StepBuffers:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int,
                 num_groups: int) -> None:
        self.device, self.max_tokens, self.max_seqs, self.max_blocks = device, max_tokens, max_seqs, max_blocks
        sizes = {"num_valid": 1, "query_start_loc": max_seqs + 1, "seq_lens": max_seqs, "sample_idx": max_seqs,
                 "sample_rows": max_seqs, "input_ids": max_tokens, "pending_src": max_tokens, "positions": max_tokens}
        for g in range(num_groups):
            sizes[f"slots{g}"] = max_tokens
        self._offsets, total = {}, 0
        for name, n in sizes.items():
            self._offsets[name] = total
            total += n
        pin = device.type == "cuda"
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._dev = torch.zeros(total, dtype=torch.int64, device=device)
        self.tables = [torch.zeros(max_seqs, max_blocks, dtype=torch.int64, device=device) for _ in range(num_groups)]
        # Pinned staging of each group's [B, m] corner: a copy from pageable memory would wait for
        # the work already queued on the stream (a step in flight, with async scheduling).
        self._host_tables = [torch.zeros(max_seqs * max_blocks, dtype=torch.int64, pin_memory=pin)
                             for _ in range(num_groups)]
        # The last upload's copies read the pinned memory asynchronously: the host waits for
        # them before writing it again.
        self._uploaded = torch.cuda.Event() if pin else None

    def fits(self, num_tokens: int, num_seqs: int, num_blocks: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and num_blocks <= self.max_blocks

    def begin(self) -> None:
        """Call before writing host views: waits until the previous upload has read them."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def host_view(self, name: str, n: int) -> np.ndarray:
        o = self._offsets[name]
        return self._host_np[o:o + n]

    def dev_view(self, name: str, n: int) -> torch.Tensor:
        o = self._offsets[name]
        return self._dev[o:o + n]

    def upload_tables(self, group: int, tables_Bm: np.ndarray) -> None:
        """Block tables [B, m] of one group into the corner of its device tensor, through its
        pinned staging buffer (written after `begin`, like the other inputs)."""
        B, m = tables_Bm.shape
        staged = self._host_tables[group][:B * m].view(B, m)
        staged.numpy()[:] = tables_Bm
        self.tables[group][:B, :m].copy_(staged, non_blocking=True)

    def upload(self, sizes: dict[str, int]) -> None:
        """Copy (at least) the first sizes[name] entries of each named input to the device, asynchronously,
        in one copy of the span from the first input to the end of the last one used (the unused tails
        inside it carry stale values no kernel reads)."""
        end = max((self._offsets[name] + n for name, n in sizes.items()), default=0)
        if end:
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
