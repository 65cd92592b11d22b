"""Pinned host and device buffers for one step's integer inputs, allocated once at the largest
step and reused: each step writes numpy views of the host side, then ONE asynchronous copy moves
the span that holds every used prefix to the device (issuing a copy costs the host the same
whatever its size, and the span is a few hundred KB at most). CUDA graphs capture views of the
same device buffers, so a replay reads whatever the last upload put there.

Inputs (all int64), the per-step and per-sequence ones first so that the span stays short: num_valid [1]
(the expert-load counters' count of real rows, moe/expert_load/counters.py, when they read it here), query_start_loc
[B+1], seq_lens [B], sample_idx [B] (the token row of each sequence that samples), sample_rows [B]
(the runner row of each sequence that samples: where its token goes in the runner's last-sampled
tokens), table_rows [B] (each sequence's row of the device block tables), the block-table writes of the
step (write_index: flat index into row_tables, write_ids: the block id), then input_ids [T], pending_src [T]
(async scheduling: the runner row whose last sampled token is this token's id, which the host does not know
yet; -1 where input_ids holds it), positions [T] and, per KV-cache group g, slots{g} [T].

Block tables: the runner's tables (moe/worker/block_tables.py) have a copy on the device, `row_tables`
[groups, rows, M] (M = the most blocks a sequence can have), kept up to date by the writes each step
uploads (the blocks added since the last step: a few, whatever the contexts' lengths), and the step's
[B, M] tables are gathered from it on the device by table_rows (`gather_tables`, inside the CUDA graphs)
into `tables`, one [max_seqs, M] tensor per group whose views the kernels and graphs read. Rows
0..max_seqs-1 of row_tables are scratch for synthetic batches (warm-up, dummy); runner row r is row
max_seqs + r.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.host_to_device import host_to_device


class StepBuffers:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int,
                 num_groups: int, runner_rows: int = 64, max_table_writes: int | None = None) -> None:
        """runner_rows: rows of the runner's block tables the device copy holds (grow_rows adds more);
        max_table_writes: the block-table writes a step uploads with its inputs (more go up apart)."""
        self.device, self.max_tokens, self.max_seqs, self.max_blocks = device, max_tokens, max_seqs, max_blocks
        self.max_table_writes = max_table_writes or max(1024, 4 * max_seqs)
        sizes = {"num_valid": 1, "query_start_loc": max_seqs + 1, "seq_lens": max_seqs, "sample_idx": max_seqs,
                 "sample_rows": max_seqs, "table_rows": max_seqs, "write_index": self.max_table_writes,
                 "write_ids": self.max_table_writes,
                 "input_ids": max_tokens, "pending_src": max_tokens, "positions": max_tokens}
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
        self.row_tables = torch.zeros(num_groups, max_seqs + runner_rows, max_blocks, dtype=torch.int64,
                                      device=device)
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

    @property
    def runner_rows(self) -> int:
        return self.row_tables.shape[1] - self.max_seqs

    def grow_rows(self, runner_rows: int) -> None:
        """Room for runner rows up to runner_rows - 1 (a CUDA graph must not have captured row_tables)."""
        if runner_rows > self.runner_rows:
            grown = self.row_tables.new_zeros(self.row_tables.shape[0], self.max_seqs + runner_rows, self.max_blocks)
            grown[:, :self.row_tables.shape[1]] = self.row_tables
            self.row_tables = grown

    def stage_table_writes(self, writes: list[tuple[int, int, int, list[int]]], scratch: bool,
                           sizes: dict[str, int]) -> int:
        """Stage block-table writes (group, row, first column, block ids; the runner's rows, or with
        `scratch` rows of the scratch part) for the next `upload`; the count staged, for
        apply_table_writes. Where a slot is written twice the later write wins. More writes than
        the span holds go up at once, on their own (still asynchronously)."""
        if not writes:
            return 0
        G, R, M = self.row_tables.shape
        base = 0 if scratch else self.max_seqs
        index: list[int] = []
        ids: list[int] = []
        rows = set()
        for g, row, col, blocks in writes:  # a decode step: a few writes of one block each
            start = (g * R + base + row) * M + col
            index.extend(range(start, start + len(blocks)))
            ids.extend(blocks)
            rows.add((g, row))
        index, ids = np.asarray(index, dtype=np.int64), np.asarray(ids, dtype=np.int64)
        if len(rows) < len(writes):  # a row written twice: keep the last
            _, last = np.unique(index[::-1], return_index=True)
            keep = len(index) - 1 - last
            index, ids = index[keep], ids[keep]
        n = len(index)
        if n > self.max_table_writes:
            self.row_tables.view(-1).index_copy_(0, host_to_device(index, self.device),
                                                 host_to_device(ids, self.device))
            return 0
        self.host_view("write_index", n)[:] = index
        self.host_view("write_ids", n)[:] = ids
        sizes["write_index"] = sizes["write_ids"] = n
        return n

    def apply_table_writes(self, n: int) -> None:
        """The n writes staged with the last upload, into row_tables (stream-ordered after the copy)."""
        if n:
            self.row_tables.view(-1).index_copy_(0, self.dev_view("write_index", n), self.dev_view("write_ids", n))

    def gather_tables(self, b: int) -> None:
        """The first b sequences' block tables, by table_rows, into each group's `tables` (a CUDA graph
        captures this with the forward: a replay gathers the rows the last upload put there)."""
        rows = self.dev_view("table_rows", b)
        for g, table in enumerate(self.tables):
            torch.index_select(self.row_tables[g], 0, rows, out=table[:b])

    def upload(self, sizes: dict[str, int]) -> None:
        """Copy (at least) the first sizes[name] entries of each named input to the device, asynchronously,
        in one copy of the span from the first input to the end of the last one used (the unused tails
        inside it carry stale values no kernel reads)."""
        end = max((self._offsets[name] + n for name, n in sizes.items()), default=0)
        if end:
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
