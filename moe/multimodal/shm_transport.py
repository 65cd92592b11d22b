"""Pixels through shared memory (mm_processor_cache_type="shm"): the API process writes each
processed image once into a shared-memory object store (moe/multimodal/shm_store.py) and sends a
small handle; every worker process that runs the vision encoder reads the pixels from the segment
itself; a repeated image is a new handle on the stored object (no new bytes).

Lifetimes: one store per (API process, engine core) connection, created by the API process. The
engine core is its one counting reader: it pins every handle a request brings until the request
finishes (or is aborted), then releases it. Workers attach as observers, which copy without
counting, so a preempted or retried request can read its images again. An image the store cannot
take (full of images of running requests, or above mm_shm_cache_max_object_size_mb) travels inline.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import torch

from moe.config import EngineArgs
from moe.multimodal.processor_cache import capacity_from_gb
from moe.multimodal.shm_store import Refused, ShmHandle, SharedMemoryObjectStore

MiB = 1 << 20
_observers: dict[str, SharedMemoryObjectStore] = {}  # this process's observer attachments, by store name


@dataclass(frozen=True)
class ShmPixels:
    """An image's pixels in a shared-memory store (what ImageItem.pixel_values holds then)."""
    store: str
    handle: list  # ShmHandle's fields (as msgpack brings them)

    def read(self) -> torch.Tensor:
        store = _observers.get(self.store)
        if store is None:
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
            name=f"moe_mm_{os.getpid()}_{uuid.uuid4().hex[:8]}")

    def place(self, key: str, pixels: torch.Tensor) -> list | None:
        """[store name, handle] of the pixels in the store, or None: send them inline."""
        handle = self.store.handle_for(key)
        if handle is None:
            handle = self.store.put(key, {"pixel_values": pixels})
            if isinstance(handle, Refused):
                return None
        return [self.store.name, list(handle)]

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

    def hold(self, request_id: str, pixels: ShmPixels) -> None:
        if pixels.store not in self._stores:
            self._stores[pixels.store] = SharedMemoryObjectStore.attach(pixels.store, 0)
        self._held.setdefault(request_id, []).append((pixels.store, pixels.handle))

    def release(self, request_id: str) -> None:
        for store, handle in self._held.pop(request_id, ()):
            self._stores[store].release(ShmHandle.of(handle))

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()
