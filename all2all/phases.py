"""Where a dispatch + combine spends its time: phase marks on the host and on the GPU stream.

A dispatcher calls `self._phase(name)` after each phase (see Dispatcher._phase); with a
PhaseTimer attached (`dispatcher.phase_timer = PhaseTimer(device)`, as `moe bench all2all
--phases` does) each mark records the host clock and, on CUDA, an event on the current stream.
A phase's host time is what the host spent between the previous mark and its own (launches,
host syncs); its device time is the GPU time between the two events (the kernels and the
collectives it enqueued, plus any wait for the host). Without a timer a mark costs one
attribute test.

Phase names used by the backends (each ends at its mark):
  route           low_latency: destination slots of the (token, rank) pairs
  count_exchange  all_to_all / AG+RS: the per-rank row counts launched across the group
  pack            the rows (x + weights + ids) written into the send buffer
  sync            all_to_all / AG+RS: the host waits for the counts (`.tolist()`)
  transfer        the dispatch collective
  unpack          received rows split into x, weights and ids (weights of other ranks zeroed)
  combine_transfer the combine collective
  combine         the per-token sum of the returned rows
"""
from __future__ import annotations

import statistics
import time

import torch


class PhaseTimer:
    """Marks of one dispatch + combine at a time: `start()`, the dispatcher's marks, then
    `phases()` once the GPU work is done (it synchronises)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._marks: list[tuple[str, float, torch.cuda.Event | None]] = []

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        self._marks = [("start", time.perf_counter(), self._event())]

    def mark(self, name: str) -> None:
        if not self._marks:
            raise RuntimeError("PhaseTimer.mark before start()")
        self._marks.append((name, time.perf_counter(), self._event()))

    def phases(self) -> list[tuple[str, float, float | None]]:
        """(name, host µs, device µs or None off CUDA) of each phase since start(), in order."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        out = []
        for (_, t0, e0), (name, t1, e1) in zip(self._marks, self._marks[1:]):
            device_us = e0.elapsed_time(e1) * 1e3 if e0 is not None else None
            out.append((name, (t1 - t0) * 1e6, device_us))
        return out


def median_phases(runs: list[list[tuple[str, float, float | None]]]) -> dict[str, dict[str, float | None]]:
    """Per phase name, the medians of its host and device µs over runs (a name seen twice in a
    run is summed there first; phases missing from some runs count as 0 there)."""
    names = list(dict.fromkeys(name for run in runs for name, _, _ in run))
    out = {}
    for name in names:
        host = [sum(h for n, h, _ in run if n == name) for run in runs]
        dev = [sum(d or 0.0 for n, _, d in run if n == name) for run in runs]
        has_device = any(d is not None for run in runs for n, _, d in run if n == name)
        out[name] = {"host_us": statistics.median(host), "device_us": statistics.median(dev) if has_device else None}
    return out
