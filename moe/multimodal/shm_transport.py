"""Pixels through shared memory (mm_processor_cache_type="shm"): the API process writes each
processed image once into a shared-memory object store (moe/multimodal/shm_store.py) and sends a
small handle; every worker process that runs the vision encoder reads the pixels from the segment
itself; a repeated image is a new handle on the stored object (no new bytes).

Lifetimes: one store per (API process, engine core) connection, created by the API process. The
engine core is its one counting reader: it pins every handle a request brings until the request
finishes (or is aborted), then releases it. Workers attach as observers, which copy without
counting, so a preempted or retried request can read its images again. An image the store cannot
take (full of images of running requests, above mm_shm_cache_max_object_size_mb, or /dev/shm out of
space) travels inline.

A store is named moe_mm_<API process pid>_<random>. An API process that dies (the launcher restarts
it) leaves its stores behind: the engine core closes and unlinks such a store once no request pins
it (ShmPins.sweep), and reclaim_stale_stores() removes what a killed process tree left.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass

import torch

from moe.config import EngineArgs
from moe.multimodal.processor_cache import capacity_from_gb
from moe.multimodal.shm_store import (Refused, ShmHandle, SharedMemoryObjectStore, _pid_alive,
                                      reclaim_stale_segments)

logger = logging.getLogger("moe.multimodal")

MiB = 1 << 20
STORE_PREFIX = "moe_mm_"
_NO_SPACE_WARNING_EVERY_S = 60.0
_SWEEP_EVERY_S = 1.0
_observers: dict[str, SharedMemoryObjectStore] = {}  # this process's observer attachments, by store name


def reclaim_stale_stores() -> list[str]:
    """Unlink the stores in /dev/shm that processes since killed left (never a live one's)."""
    return reclaim_stale_segments(STORE_PREFIX)


def _drop_dead_observers() -> None:
    # A store whose writer is gone gets no new handles: its mapping (pages included) can go.
    for name, store in list(_observers.items()):
        if not _pid_alive(store.writer_pid):
            del _observers[name]
            store.close()


@dataclass(frozen=True)
class ShmPixels:
    """An image's pixels in a shared-memory store (what ImageItem.pixel_values holds then)."""
    store: str
    handle: list  # ShmHandle's fields (as msgpack brings them)

    def read(self) -> torch.Tensor:
        store = _observers.get(self.store)
        if store is None:
            _drop_dead_observers()  # a new store: perhaps the one of a restarted API process
            store = _observers[self.store] = SharedMemoryObjectStore.attach(self.store, None)
        return store.get(ShmHandle.of(self.handle))["pixel_values"]


def pixels_of(value) -> torch.Tensor:
    """ImageItem.pixel_values as a tensor (read from shared memory when it is a handle)."""
    return value.read() if isinstance(value, ShmPixels) else value


class ShmSender:
    """The API side: one store per engine core it sends to."""

    def __init__(self, args: EngineArgs) -> None:
        self.store = SharedMemoryObjectStore(
            capacity_from_gb(args.mm_processor_cache_gb), num_readers=1,
            max_object_bytes=args.mm_shm_cache_max_object_size_mb * MiB,
            name=f"{STORE_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:8]}")
        self._warned_at: float | None = None

    def place(self, key: str, pixels: torch.Tensor) -> list | None:
        """[store name, handle] of the pixels in the store, or None: send them inline."""
        handle = self.store.handle_for(key)
        if handle is None:
            handle = self.store.put(key, {"pixel_values": pixels})
            if handle is Refused.NO_SPACE:
                self._warn_no_space()
            if isinstance(handle, Refused):
                return None
        return [self.store.name, list(handle)]

    def _warn_no_space(self) -> None:
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= _NO_SPACE_WARNING_EVERY_S:
            self._warned_at = now
            logger.warning("/dev/shm is full: images go to the engine core inline (slower) until it has room "
                           "again (%d refused so far; enlarge /dev/shm, e.g. docker run --shm-size, or lower "
                           "mm_processor_cache_gb)", self.store.refused_no_space)

    def close(self) -> None:
        self.store.close()


def shm_sender(args: EngineArgs) -> ShmSender | None:
    if args.mm_processor_cache_type != "shm" or not args.mm_processor_cache_gb:
        return None
    return ShmSender(args)


class ShmPins:
    """The engine-core side: holds each request's handles until the request leaves the core."""

    def __init__(self) -> None:
        self._stores: dict[str, SharedMemoryObjectStore] = {}
        self._held: dict[str, list[tuple[str, tuple]]] = {}
        self._pins: dict[str, int] = {}  # store -> handles held in it
        self._swept_at = 0.0

    def hold(self, request_id: str, pixels: ShmPixels) -> None:
        if pixels.store not in self._stores:
            self._stores[pixels.store] = SharedMemoryObjectStore.attach(pixels.store, 0)
        self._held.setdefault(request_id, []).append((pixels.store, pixels.handle))
        self._pins[pixels.store] = self._pins.get(pixels.store, 0) + 1

    def release(self, request_id: str) -> None:
        for store, handle in self._held.pop(request_id, ()):
            self._stores[store].release(ShmHandle.of(handle))
            self._pins[store] -= 1

    def sweep(self) -> None:
        """Close and unlink the stores of API processes that are gone, once nothing pins them (this
        core is their one counting reader, so nobody else will); at most once a second."""
        now = time.monotonic()
        if now - self._swept_at < _SWEEP_EVERY_S:
            return
        self._swept_at = now
        for name, store in list(self._stores.items()):
            if self._pins.get(name, 0) == 0 and not _pid_alive(store.writer_pid):
                del self._stores[name]
                self._pins.pop(name, None)
                store.close()
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
                logger.info("closed the shared-memory store %s of a process that is gone", name)

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()
