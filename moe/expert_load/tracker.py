"""The host side of expert-load recording: windows, totals since a reset, the recording file, and
what `LLM.get_expert_load()` returns.

Legend: L MoE layers (all pipeline stages), E logical experts, P physical experts (E + EPLB's
redundant slots), G expert-parallel ranks (1 without expert parallelism).

The counters on the devices only grow (moe/expert_load/counters.py). Every `window_steps` engine steps
the engine reads a snapshot summed over ranks and folds the difference from the previous one into
a window (moe/expert_load/recording.py's ExpertLoadWindow). Totals since the last reset are the
difference from the snapshot taken at that reset, so nothing on the devices is ever cleared.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from moe.expert_load.recording import ExpertLoadMeta, ExpertLoadWindow, RecordingWriter, balancedness_of

logger = logging.getLogger("moe.expert_load.tracker")

KEPT_WINDOWS = 2000  # in memory: EPLB's load window here, the live dashboard in the API process


@dataclass
class ExpertLoad:
    """Tokens routed since start-up or the last reset (a token with top-k 8 counts 8 times).

    counts: int64 [L, E] per logical expert; layers: the decoder-layer index of each row;
    per_rank: int64 [L, G] rows each expert-parallel rank processed (G = 1 without expert
    parallelism); balancedness: float64 [L] mean / max of per_rank (1.0 for an idle layer);
    physical_counts: int64 [L, P] per physical slot (== counts without EPLB); num_steps: engine
    steps covered."""
    counts: np.ndarray
    layers: list[int]
    per_rank: np.ndarray
    balancedness: np.ndarray
    physical_counts: np.ndarray
    num_steps: int

    @property
    def total_tokens(self) -> int:
        return int(self.counts.sum())


def physical_slot_ranks(num_physical: int, ep_size: int, owner_of_expert: np.ndarray | None = None) -> np.ndarray:
    """[P] the expert-parallel rank of each physical slot: slot p on rank p // (P / G) under
    EPLB, or the placement's owner of expert p without it (`owner_of_expert`)."""
    if owner_of_expert is not None:
        return np.asarray(owner_of_expert, dtype=np.int64)
    return np.arange(num_physical, dtype=np.int64) // (num_physical // ep_size)


class ExpertLoadTracker:
    def __init__(self, meta: ExpertLoadMeta, slot_rank_P: np.ndarray, snapshot: dict, step: int) -> None:
        self.meta = meta
        self.slot_rank_P = np.asarray(slot_rank_P, dtype=np.int64)
        self.windows: deque[ExpertLoadWindow] = deque(maxlen=KEPT_WINDOWS)
        self.rebalances = 0
        self._next_index = 0
        self._last, self._last_step = snapshot, step
        self._baseline, self._baseline_step = snapshot, step
        self._writer: RecordingWriter | None = None

    def per_rank_of(self, physical_LP: np.ndarray) -> np.ndarray:
        """[L, G] rows per rank: physical counts summed by the rank of their slot."""
        out = np.zeros((physical_LP.shape[0], self.meta.ep_size), dtype=np.int64)
        for rank in range(self.meta.ep_size):
            out[:, rank] = physical_LP[:, self.slot_rank_P == rank].sum(axis=1)
        return out

    def fold(self, snapshot: dict, step: int) -> ExpertLoadWindow | None:
        """Close a window over the steps since the previous fold (None when there were none)."""
        if step <= self._last_step:
            return None
        counts = snapshot["logical"] - self._last["logical"]
        per_rank = self.per_rank_of(snapshot["physical"] - self._last["physical"])
        window = ExpertLoadWindow.build(self._next_index, self._last_step, step, time.time(), counts, per_rank)
        self.windows.append(window)
        self._next_index += 1
        self._last, self._last_step = snapshot, step
        if self._writer is not None:
            self._writer.write_window(window)
        return window

    def totals(self) -> ExpertLoad:
        """Since the last reset, up to the last fold."""
        counts = self._last["logical"] - self._baseline["logical"]
        physical = self._last["physical"] - self._baseline["physical"]
        per_rank = self.per_rank_of(physical)
        return ExpertLoad(counts, list(self.meta.layers), per_rank, balancedness_of(per_rank), physical,
                          self._last_step - self._baseline_step)

    def reset(self) -> None:
        self._baseline, self._baseline_step = self._last, self._last_step

    def recent_counts(self, steps: int) -> np.ndarray:
        """[L, E] logical counts of the windows that end within the last `steps` steps."""
        total = np.zeros((self.meta.num_layers, self.meta.num_experts), dtype=np.int64)
        for w in self.windows:
            if w.step_end > self._last_step - steps:
                total += w.counts
        return total

    def note_placement(self, phys_to_log_LP: np.ndarray) -> None:
        """EPLB moved experts after the newest window."""
        self.rebalances += 1
        if self._writer is not None:
            self._writer.write_placement(self._next_index - 1, phys_to_log_LP)

    # ---- the recording file -----------------------------------------------
    def start_recording(self, path: str) -> None:
        """Write every window from now on to `path` (JSON lines, moe/expert_load/recording.py)."""
        if self._writer is not None:
            self._writer.close()
        self._writer = RecordingWriter(path, self.meta)
        logger.info("Recording expert load to %s (a window every %d steps)", path, self.meta.window_steps)

    def stop_recording(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class ExpertLoadAPI:
    """What LLM's expert-load methods do on an engine core (folding first, so the answer covers
    every step run so far)."""

    def __init__(self, core) -> None:
        self.core, self.tracker = core, core.expert_load

    def get(self) -> ExpertLoad:
        self.core.fold_expert_load()
        return self.tracker.totals()

    def reset(self) -> None:
        self.core.fold_expert_load()
        self.tracker.reset()

    def start_recording(self, path: str) -> None:
        self.core.fold_expert_load()  # the file starts with the steps that come next
        self.tracker.start_recording(path)

    def stop_recording(self) -> None:
        self.core.fold_expert_load()  # the steps run since the last window go into the file
        self.tracker.stop_recording()

