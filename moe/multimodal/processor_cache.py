"""Caches of processed multimodal inputs (pixel_values + metadata), bounded in bytes, LRU.

ProcessorCache: one process's cache, key -> processed item (vLLM's mm_processor_cache_gb, default 4).

SenderCache / ReceiverCache: the IPC pair. The sender lives in the API process and keeps only
keys and sizes; the receiver lives in the engine core and keeps the items. For each image of a
request, in order:

    API process:   item_or_none = sender.prepare(key, item)     # None: a hit, send only the key
    engine core:   item = receiver.resolve(key, item_or_none)

Both sides run the same LRU updates (a hit moves the key to the back; a miss inserts it and evicts
from the front until it fits; an item larger than the capacity is stored on neither side), so they
evict the same keys in the same order and the receiver always holds what the sender believes it
holds. That holds only if:
  * the receiver resolves exactly the (key, item) pairs the sender prepared, in the order they were
    prepared (one ordered channel per sender/receiver pair: one receiver per API process; a request
    prepared and then dropped before it was sent desynchronises them: send it anyway, or clear both);
  * the size function gives the same size for the item on both sides (the default counts tensor
    bytes, which survive serialisation when tensors come back as tensors of the same dtype/shape).
A receiver asked for a key it does not hold raises CacheDesyncError (a bug, never a normal miss).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch

GiB = 1 << 30


def capacity_from_gb(gb: float) -> int:
    """mm_processor_cache_gb (a float, GiB) as bytes; 0 turns the cache off."""
    if gb < 0:
        raise ValueError(f"mm_processor_cache_gb must be >= 0, got {gb}")
    return int(gb * GiB)


def tensor_nbytes(item: Any) -> int:
    """Bytes of the tensors (torch or numpy) in `item`, found recursively in dataclasses, dicts,
    lists and tuples; everything else (ints, strings, small metadata) counts 0."""
    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if hasattr(item, "__array_interface__") and hasattr(item, "nbytes"):  # numpy arrays
        return int(item.nbytes)
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(tensor_nbytes(getattr(item, f.name)) for f in dataclasses.fields(item))
    if isinstance(item, dict):
        return sum(tensor_nbytes(v) for v in item.values())
    if isinstance(item, (list, tuple)):
        return sum(tensor_nbytes(v) for v in item)
    return 0


class CacheDesyncError(RuntimeError):
    """The receiver was told it holds an item it does not: the sender/receiver pair lost lockstep."""


class _SizedLRU:
    """key -> (value, size) in least- to most-recently-used order, total size <= capacity."""

    def __init__(self, capacity_bytes: int) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"cache capacity must be an int >= 0 bytes, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.total_bytes = 0
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()

    def peek(self, key: Hashable) -> tuple[Any, int] | None:
        """The entry of `key` without moving it; None when absent."""
        return self._entries.get(key)

    def touch(self, key: Hashable) -> tuple[Any, int] | None:
        """The entry of `key`, moved to the most-recently-used end; None when absent."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def insert(self, key: Hashable, value: Any, size: int) -> bool:
        """Store (replacing any entry of `key`), evicting from the LRU end until it fits.
        An item larger than the whole capacity is not stored (and evicts nothing): False."""
        if size < 0:
            raise ValueError(f"item size must be >= 0 bytes, got {size}")
        if size > self.capacity_bytes or self.capacity_bytes == 0:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[1]
        while self.total_bytes + size > self.capacity_bytes:
            _, (_, evicted_size) = self._entries.popitem(last=False)
            self.total_bytes -= evicted_size
        self._entries[key] = (value, size)
        self.total_bytes += size
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.total_bytes = 0

    def keys(self) -> list:
        return list(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class _Counted:
    """hits / queries counters (queries = lookups, hits = lookups that found the key)."""
    hits: int = 0
    queries: int = 0

    def reset_counters(self) -> None:
        self.hits = 0
        self.queries = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class _SizedCache(_Counted):
    """What the three caches share: an LRU bounded by size_fn(item) bytes (default: tensor bytes)."""

    def __init__(self, capacity_bytes: int, size_fn: Callable[[Any], int] = tensor_nbytes) -> None:
        self._lru = _SizedLRU(capacity_bytes)
        self._size_fn = size_fn

    @property
    def capacity_bytes(self) -> int:
        return self._lru.capacity_bytes

    @property
    def total_bytes(self) -> int:
        return self._lru.total_bytes

    def clear(self) -> None:
        """Forget everything (a sender and its receiver are cleared at the same point of their stream)."""
        self._lru.clear()

    def keys(self) -> list:
        """Keys from least to most recently used."""
        return self._lru.keys()

    def __contains__(self, key: Hashable) -> bool:  # no LRU update, no counting
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)


class ProcessorCache(_SizedCache):
    """LRU of key -> processed item, bounded by the items' total size (size_fn, default tensor bytes).

    capacity_bytes 0 turns it off: every get misses, nothing is stored."""

    def get(self, key: Hashable) -> Any | None:
        """The item of `key` (now most recently used), or None; counts a query (and a hit)."""
        self.queries += 1
        entry = self._lru.touch(key)
        if entry is None:
            return None
        self.hits += 1
        return entry[0]

    def put(self, key: Hashable, item: Any) -> bool:
        """Store `item` under `key`, evicting least recently used items; False when not stored
        (cache off, or the item alone is larger than the capacity)."""
        return self._lru.insert(key, item, self._size_fn(item))


class SenderCache(_SizedCache):
    """The API-process half of the IPC pair: keys, sizes and small metadata, no items (see the module doc)."""

    def prepare(self, key: Hashable, item: Any, meta: Any = None) -> Any | None:
        """What to send for this image: None when the receiver holds `key` (send only the key),
        else `item` itself (the receiver will store it if it fits). Call once per image, in send order.
        meta: small data kept with the key (what the API side needs of an item it no longer holds)."""
        self.queries += 1
        if self._lru.touch(key) is not None:
            self.hits += 1
            return None
        self._lru.insert(key, meta, self._size_fn(item))
        return item

    def metadata(self, key: Hashable) -> Any | None:
        """The meta kept with `key` (None when absent); no LRU update, no counting."""
        entry = self._lru.peek(key)
        return None if entry is None else entry[0]


class ReceiverCache(_SizedCache):
    """The engine-core half of the IPC pair: holds the items the sender believes it holds."""

    def resolve(self, key: Hashable, item: Any | None) -> Any:
        """The item of this image: `item` when the sender sent it (stored here if it fits), else the
        held item of `key`. Raises CacheDesyncError when `item` is None and `key` is not held."""
        self.queries += 1
        if item is None:
            entry = self._lru.touch(key)
            if entry is None:
                raise CacheDesyncError(
                    f"multimodal receiver cache has no item for key {key!r} although the sender sent only the "
                    f"key (sender and receiver out of lockstep: messages lost, reordered, or resolved by "
                    f"another receiver; {len(self._lru)} items held)")
            self.hits += 1
            return entry[0]
        self._lru.insert(key, item, self._size_fn(item))
        return item

