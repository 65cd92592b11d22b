"""Block tables kept across steps on the host: one row per request the runner tracks, one table per
KV-cache group. A step only appends the blocks the scheduler added, and the batch's tables are one
fancy-index gather of its rows, instead of rebuilding [B, max_blocks] from Python lists each step.

Tables and the row count grow on demand (doubling), so no size needs to be known up front.

On CUDA a copy of the tables lives on the device (moe/worker/step_buffers.py): every write is also
logged (`take_writes`), so that a step uploads only the blocks added since the last one.
"""
from __future__ import annotations

import numpy as np


class BlockTables:
    def __init__(self, num_groups: int, rows: int = 64, cols: int = 64, log_writes: bool = False) -> None:
        """log_writes: keep the log that take_writes empties (a device copy follows the tables)."""
        self.tables = [np.zeros((rows, cols), dtype=np.int64) for _ in range(num_groups)]
        self.lens = [np.zeros(rows, dtype=np.int64) for _ in range(num_groups)]
        self._free: list[int] = list(range(rows - 1, -1, -1))
        # (group, row, first column, block ids) of each write since the last take_writes
        self._writes: list[tuple[int, int, int, list[int]]] | None = [] if log_writes else None

    @property
    def num_groups(self) -> int:
        return len(self.tables)

    def add(self, block_ids: list[list[int]]) -> int:
        """A new request's blocks (one list per group) -> its row."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        for g, ids in enumerate(block_ids):
            self.lens[g][row] = 0
            self.extend(row, g, ids)
        return row

    def extend(self, row: int, group: int, ids) -> None:
        if not ids:
            return
        n, k = int(self.lens[group][row]), len(ids)
        if n + k > self.tables[group].shape[1]:
            self._grow_cols(group, n + k)
        self.tables[group][row, n:n + k] = ids
        self.lens[group][row] = n + k
        if self._writes is not None:
            self._writes.append((group, row, n, ids))

    def take_writes(self) -> list[tuple[int, int, int, list[int]]]:
        """The writes since the last call, oldest first: (group, row, first column, block ids)."""
        if self._writes is None:
            raise RuntimeError("these block tables keep no log of their writes (log_writes=False)")
        writes, self._writes = self._writes, []
        return writes

    def remove(self, row: int) -> None:
        self._free.append(row)

    def gather(self, group: int, rows: np.ndarray) -> np.ndarray:
        """[B, m] block tables of the given rows, m = the longest of them (padding is stale, never read)."""
        m = int(self.lens[group][rows].max())
        return self.tables[group][rows, :m]

    def _grow_rows(self) -> None:
        old = self.tables[0].shape[0]
        self.tables = [np.concatenate((t, np.zeros_like(t))) for t in self.tables]
        self.lens = [np.concatenate((n, np.zeros_like(n))) for n in self.lens]
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_cols(self, group: int, needed: int) -> None:
        t = self.tables[group]
        cols = max(needed, 2 * t.shape[1])
        self.tables[group] = np.concatenate((t, np.zeros((t.shape[0], cols - t.shape[1]), dtype=t.dtype)), axis=1)
