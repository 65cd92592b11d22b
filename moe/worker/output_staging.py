"""Pinned host memory and CUDA events for a step's sampled outputs on their way to the host, reused
from step to step instead of a fresh pinned allocation and event for each output of each step
(ModelRunner's PendingStep takes them, and gives them back once it has read its outputs)."""
from __future__ import annotations

import torch


class PinnedStaging:
    """Pinned buffers by size class (a power of two of bytes, so a few classes serve every batch
    size) and recorded-then-read events. A buffer or event is handed out to one step at a time: taken
    when the step's copies are queued, given back after the host has waited for them and read them."""

    def __init__(self) -> None:
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._events: list[torch.cuda.Event] = []

    def copy_of(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a pinned host copy of t, queued asynchronously; the buffer under it, to give back)."""
        nbytes = t.numel() * t.element_size()
        size = 1 << max(nbytes - 1, 0).bit_length()
        free = self._buffers.get(size)
        raw = free.pop() if free else torch.empty(size, dtype=torch.uint8, pin_memory=True)
        staged = raw[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t, non_blocking=True)
        return staged, raw

    def event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event()

    def give_back(self, raws: list[torch.Tensor], event: torch.cuda.Event | None) -> None:
        """Buffers from copy_of and an event, once nothing reads them any more."""
        for raw in raws:
            self._buffers.setdefault(raw.numel(), []).append(raw)
        if event is not None:
            self._events.append(event)
