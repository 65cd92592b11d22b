"""The engine side of returned routed experts (enable_return_routed_experts, router replay).

Each step's runner output carries the routed expert ids of its tokens, [T, L, K] int16 in the
batch's order (moe/worker/routed_experts.py). The engine core files them by request and token
position (`RoutedExpertsTracker.record`), and every output of a request carries the rows written
since its last one (`attach`); the output side (moe/engine/output_processor.py) reassembles them and
the finished CompletionOutput holds `routed_experts`, [num_forwarded_tokens, L, K]: every prompt
token and every generated one but the last (which no forward has seen yet).

Rows are keyed by position, so a request that is preempted and recomputed rewrites its rows (and an
output re-sends them from the lowest rewritten position). A prefix-cache hit skips the forward of
its cached tokens: with prefix caching on, the rows of every computed token are also kept by KV
block (a host array [num_blocks, block_size, L, K], indexed by the full-attention group's block ids),
and a hit copies the cached blocks' rows, which the request that computed them wrote.
"""
from __future__ import annotations

import numpy as np

from scheduler import SchedulerOutput
from scheduler.output import EngineCoreOutput
from scheduler.request import RequestStatus


class RoutedRows:
    """A growing [positions, L, K] int16 array written by position: a write at `start` makes rows
    [start, start + n) the newest and drops whatever lay beyond them."""

    def __init__(self) -> None:
        self.rows: np.ndarray | None = None
        self.length = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if self.rows is None or end > len(self.rows) or self.rows.shape[1:] != rows.shape[1:]:
            grown = np.zeros((max(end, 2 * (len(self.rows) if self.rows is not None else 0), 16),) + rows.shape[1:],
                             dtype=np.int16)
            if self.rows is not None and self.rows.shape[1:] == rows.shape[1:]:
                grown[:self.length] = self.rows[:self.length]
            self.rows = grown
        if start > self.length:
            raise ValueError(f"routed experts written at position {start} beyond the {self.length} known")
        self.rows[start:end] = rows
        self.length = end

    def view(self, n: int) -> np.ndarray | None:
        """The first n rows (a copy), None when fewer are known."""
        if self.rows is None or n > self.length:
            return None
        return self.rows[:n].copy()


class _Entry:
    __slots__ = ("rows", "sent")

    def __init__(self) -> None:
        self.rows = RoutedRows()
        self.sent = 0  # rows [0, sent) went out with an earlier output


def step_starts(so: SchedulerOutput) -> dict[str, int]:
    """Each scheduled request's first position in the step (its computed tokens before it)."""
    starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens))
    return starts


class RoutedExpertsTracker:
    """Per request its rows so far; per data-parallel replica (scheduler) with prefix caching, the rows
    of its KV blocks."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = schedulers
        self._entries: dict[str, _Entry] = {}
        self._block_rows: list[np.ndarray | None] = [None] * len(schedulers)  # made at the first step

    def record(self, replica: int, so: SchedulerOutput, routed_TLK: np.ndarray | None) -> None:
        """File one step's rows (before the scheduler applies the step: its finished requests still
        hold their blocks)."""
        if routed_TLK is None or not so.num_scheduled_tokens:
            return
        sched = self.schedulers[replica]
        kv, bs = sched.kv, sched.config.block_size
        store = self._block_rows[replica]
        if store is None and kv.enable_caching:
            store = self._block_rows[replica] = np.zeros((kv.num_blocks, bs) + routed_TLK.shape[1:], dtype=np.int16)
        starts = step_starts(so)
        offset = 0
        for req_id, n in so.num_scheduled_tokens.items():
            rows = routed_TLK[offset:offset + n]
            offset += n
            request = sched.requests.get(req_id)
            if request is None:  # aborted while the step ran
                continue
            entry = self._entries.get(req_id)
            if entry is None:
                entry = self._entries[req_id] = _Entry()
            start = starts[req_id]
            blocks = kv.block_ids(request)[0] if store is not None else None
            if start > entry.rows.length:  # a prefix-cache hit: the cached blocks' rows
                if store is None:
                    raise RuntimeError(f"request {req_id!r} starts at position {start} without prefix caching, "
                                       f"but only {entry.rows.length} of its positions were computed")
                positions = np.arange(entry.rows.length, start)
                entry.rows.write(entry.rows.length, store[np.asarray(blocks)[positions // bs], positions % bs])
            entry.rows.write(start, rows)
            entry.sent = min(entry.sent, start)
            # A request preempted since this step was scheduled holds no blocks now.
            if store is not None and request.status == RequestStatus.RUNNING and len(blocks) * bs >= start + n:
                positions = np.arange(start, start + n)
                store[np.asarray(blocks)[positions // bs], positions % bs] = rows

    def attach(self, outputs: list[EngineCoreOutput]) -> None:
        """Give each output its request's rows written since its last output; forget finished requests."""
        for co in outputs:
            entry = self._entries.get(co.req_id)
            if entry is None:
                continue
            length = entry.rows.length
            if length > entry.sent:
                co.routed_experts_start = entry.sent
                co.routed_experts = entry.rows.rows[entry.sent:length].copy()
                entry.sent = length
            if co.finished:
                del self._entries[co.req_id]

    def forget_finished(self) -> None:
        """Drop the rows of requests no scheduler holds any more (aborted, stopped by a string, failed)."""
        held = [s.requests for s in self.schedulers]
        for req_id in [r for r in self._entries if not any(r in h for h in held)]:
            del self._entries[req_id]
