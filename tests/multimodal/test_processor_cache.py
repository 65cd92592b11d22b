"""The processed-input LRU cache and the sender/receiver IPC pair (lockstep, desync error)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from moe.multimodal.processor_cache import (CacheDesyncError, ProcessorCache, ReceiverCache, SenderCache,
                                            capacity_from_gb, tensor_nbytes)


@dataclasses.dataclass
class Processed:
    pixel_values: torch.Tensor  # [tiles, 3, H, W] bf16
    aspect_ratio: tuple
    extra: dict


def _item(tiles: int, seed: int = 0, side: int = 4) -> Processed:
    g = torch.Generator().manual_seed(seed)
    pv = torch.randn(tiles, 3, side, side, generator=g).to(torch.bfloat16)
    return Processed(pv, (1, tiles), {"mask": torch.ones(tiles, dtype=torch.int32), "n": tiles})


TILE = 3 * 4 * 4 * 2  # bytes of one tile of _item's pixel values


def test_tensor_nbytes_recurses():
    item = _item(5)
    assert tensor_nbytes(item) == 5 * TILE + 5 * 4
    assert tensor_nbytes({"a": [torch.zeros(3, dtype=torch.float64), (torch.zeros(2, 2),)], "s": "x"}) == 24 + 16
    assert tensor_nbytes(7) == 0
    assert capacity_from_gb(4) == 4 << 30 and capacity_from_gb(0) == 0
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        capacity_from_gb(-1)


def test_hits_and_lru_eviction_order():
    size = lambda item: item  # noqa: E731  (items are their own sizes here)
    cache = ProcessorCache(10, size_fn=size)
    assert cache.put("a", 4) and cache.put("b", 3) and cache.put("c", 3)
    assert cache.get("a") == 4  # a is now most recent: b is the oldest
    assert cache.get("zz") is None
    assert (cache.hits, cache.queries) == (1, 2)
    assert cache.put("d", 2)  # 12 > 10: evicts b (least recently used) only
    assert cache.keys() == ["c", "a", "d"] and cache.total_bytes == 9
    assert cache.put("e", 6)  # evicts c then a
    assert cache.keys() == ["d", "e"] and cache.total_bytes == 8
    assert cache.put("d", 5)  # replacing an entry re-sizes it: 11 > 10 evicts e
    assert cache.keys() == ["d"] and cache.total_bytes == 5
    cache.reset_counters()
    assert (cache.hits, cache.queries, cache.hit_rate) == (0, 0, 0.0)


def test_real_items_and_oversize():
    cache = ProcessorCache(3 * TILE + 3 * 4)
    small, big = _item(3, seed=1), _item(4, seed=2)
    assert cache.put("small", small)
    assert not cache.put("big", big)  # larger than the capacity: never stored, evicts nothing
    assert "big" not in cache and cache.get("small") is small


def test_capacity_zero_is_off():
    cache = ProcessorCache(0)
    assert not cache.put("a", _item(1))
    assert cache.get("a") is None and len(cache) == 0
    assert (cache.hits, cache.queries) == (0, 1)
    with pytest.raises(ValueError, match="capacity"):
        ProcessorCache(-1)


def _clone(item: Processed) -> Processed:
    """What the receiver gets: a copy (as after serialisation), not the sender's object."""
    return Processed(item.pixel_values.clone(), tuple(item.aspect_ratio),
                     {"mask": item.extra["mask"].clone(), "n": item.extra["n"]})


def _equal(a: Processed, b: Processed) -> bool:
    return (torch.equal(a.pixel_values, b.pixel_values) and a.aspect_ratio == b.aspect_ratio
            and torch.equal(a.extra["mask"], b.extra["mask"]) and a.extra["n"] == b.extra["n"])


@pytest.mark.parametrize("capacity_tiles", [0, 7, 40])
def test_sender_receiver_lockstep_long_random_sequence(capacity_tiles):
    rng = random.Random(capacity_tiles)
    capacity = capacity_tiles * (TILE + 4)
    sender, receiver = SenderCache(capacity), ReceiverCache(capacity)
    originals = {f"img{k}": _item(rng.randint(1, 9), seed=k) for k in range(30)}  # some bigger than capacity 7
    sent_inline = 0
    for _ in range(2000):
        request = [rng.choice(list(originals)) for _ in range(rng.randint(1, 4))]  # repeats within a request too
        wire = []
        for key in request:
            prepared = sender.prepare(key, originals[key])
            sent_inline += prepared is not None
            wire.append((key, None if prepared is None else _clone(prepared)))
        for key, item in wire:
            resolved = receiver.resolve(key, item)
            assert _equal(resolved, originals[key]), key
        assert sender.keys() == receiver.keys()  # same keys in the same LRU order
        assert sender.total_bytes == receiver.total_bytes <= capacity
    assert (sender.hits, sender.queries) == (receiver.hits, receiver.queries)
    assert sender.queries - sender.hits == sent_inline
    if capacity_tiles == 0:
        assert sender.hits == 0 and len(receiver) == 0
    else:
        assert 0 < sender.hits < sender.queries  # both hits and evictions happened


def test_sender_keeps_no_items():
    sender = SenderCache(10_000)
    item = _item(2)
    assert sender.prepare("a", item) is item
    assert sender.prepare("a", item) is None
    assert all(value is None for value, _ in sender._lru._entries.values())


def test_receiver_raises_on_desync():
    capacity = 2 * (TILE + 4)
    sender, receiver = SenderCache(capacity), ReceiverCache(capacity)
    a, b, c = _item(1, 1), _item(1, 2), _item(1, 3)
    messages = [(k, sender.prepare(k, v)) for k, v in [("a", a), ("b", b), ("c", c)]]  # c evicts a
    assert sender.prepare("b", b) is None  # a hit: only the key goes
    del messages[1]  # the message carrying b is lost
    for key, item in messages:
        receiver.resolve(key, item)
    with pytest.raises(CacheDesyncError, match="'b'.*lockstep"):
        receiver.resolve("b", None)
    with pytest.raises(CacheDesyncError):
        ReceiverCache(0).resolve("x", None)
