"""The shared-memory object store: round trips, hits, FIFO eviction gated by the readers' counters,
the per-object limit, readers in other processes, and no /dev/shm leftovers (close, SIGKILL)."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import torch

from moe.multimodal.shm_store import Refused, SharedMemoryObjectStore, ShmHandle, StaleHandleError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KiB = 1024


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _obj(seed: int, tiles: int = 2, side: int = 16) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(tiles, 3, side, side, generator=g).to(torch.bfloat16),
        "scores": torch.randn(7, generator=g),
        "ids": torch.randint(-2**40, 2**40, (3, 5), generator=g),
        "mask": torch.rand(4, generator=g) > 0.5,
        "scalar": torch.tensor(seed, dtype=torch.int16),
        "empty": torch.empty(0, 3),
        "aspect_ratio": [1, tiles],
        "note": f"image {seed}",
    }


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture
def store():
    writer = SharedMemoryObjectStore(64 * KiB, num_readers=2, max_object_bytes=32 * KiB)
    readers = [SharedMemoryObjectStore.attach(writer.name, i) for i in range(2)]
    yield writer, readers
    for r in readers:
        r.close()
    writer.close()


def test_round_trip_copy_views_and_wire_forms(store):
    writer, (r0, r1) = store
    want = _obj(1)
    h = writer.put("a", want)
    assert isinstance(h, ShmHandle)
    _assert_same(r0.get(pickle.loads(pickle.dumps(h))), want)
    wire = msgpack.unpackb(msgpack.packb(h), raw=False)  # nested lists, as after the engine's messages
    views = r1.get(wire, copy=False)
    _assert_same(views, want)
    assert views["pixel_values"].untyped_storage().data_ptr() != want["pixel_values"].untyped_storage().data_ptr()
    r1.release(wire)
    with pytest.raises(TypeError, match="JSON-able"):
        writer.put("bad", {"t": torch.zeros(1), "nested": [torch.zeros(1)]})
    with pytest.raises(TypeError, match="dict with str keys"):
        writer.put("bad", [torch.zeros(1)])


def test_hits_reference_without_new_bytes(store):
    writer, (r0, r1) = store
    assert writer.handle_for("a") is None
    h1 = writer.put("a", _obj(1))
    used = writer.used_bytes
    h2 = writer.handle_for("a")
    assert h2 == h1 and writer.used_bytes == used and writer.num_objects == 1
    assert writer.put("a", _obj(99)) == h1  # a stored key is referenced again, not rewritten
    assert (writer.hits, writer.queries) == (1, 2)
    _assert_same(r0.get(h2), _obj(1))
    writer.reset_counters()
    assert (writer.hits, writer.queries) == (0, 0)


def _fill(writer, readers, keys, release=True):
    handles = {}
    for k in keys:
        h = writer.put(k, _obj(int(k[1:])))
        assert isinstance(h, ShmHandle), (k, h)
        handles[k] = h
        if release:
            for r in readers:
                r.release(h)
    return handles


def test_fifo_eviction_when_readers_are_done(store):
    writer, readers = store
    per_object = _fill(writer, readers, ["k0"])["k0"].size
    fits = writer.capacity_bytes // per_object
    handles = _fill(writer, readers, [f"k{i}" for i in range(1, fits + 3)])
    assert writer.evictions == 3 and writer.num_objects == fits
    assert writer.keys() == [f"k{i}" for i in range(3, fits + 3)]  # the oldest went first
    assert writer.handle_for("k0") is None and writer.handle_for("k2") is None
    with pytest.raises(StaleHandleError, match="no longer at offset"):
        readers[0].get(handles["k1"])


def test_full_while_a_reader_lags_then_room_after_it_catches_up(store):
    writer, (r0, r1) = store
    per_object = writer.put("k0", _obj(0)).size
    fits = writer.capacity_bytes // per_object
    handles = [writer.handle_for("k0")] + list(_fill(writer, [], [f"k{i}" for i in range(1, fits)], False).values())
    handles.insert(0, handles[0])  # k0 has two references (put + hit)
    for h in handles:
        _assert_same(r0.get(h), _obj(int(h.key[1:])))  # reader 0 is done with everything
    assert writer.put("new", _obj(100)) is Refused.FULL  # reader 1 still holds k0
    assert writer.refused_full == 1 and writer.num_objects == fits
    r1.release(handles[0])
    assert writer.put("new", _obj(100)) is Refused.FULL  # k0's second reference is still unread
    r1.get(handles[1])
    h = writer.put("new", _obj(100))
    assert isinstance(h, ShmHandle) and writer.keys()[0] == "k1" and writer.keys()[-1] == "new"
    _assert_same(r1.get(handles[2]), _obj(1))  # k1 survived: only what was needed went


def test_per_object_limit(store):
    writer, _ = store
    big = {"pixel_values": torch.randn(40 * KiB // 4)}
    assert writer.put("big", big) is Refused.TOO_LARGE
    assert writer.refused_too_large == 1 and writer.num_objects == 0 and writer.handle_for("big") is None


def test_ring_wraps_with_random_sizes_and_random_release_order():
    rng = random.Random(0)
    writer = SharedMemoryObjectStore(48 * KiB, num_readers=2)
    readers = [SharedMemoryObjectStore.attach(writer.name, i) for i in range(2)]
    pending = {0: [], 1: []}
    originals, stored = {}, 0
    for step in range(400):
        key = f"k{rng.randrange(60)}"
        obj = originals.setdefault(key, {"x": torch.randn(rng.randint(1, 3000)), "step": len(originals)})
        h = writer.handle_for(key) or writer.put(key, obj)
        if isinstance(h, ShmHandle):
            stored += 1
            for i in range(2):
                pending[i].append(h)
        live = sorted((writer._by_key[k].handle.offset, writer._by_key[k].end) for k in writer.keys())
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(live, live[1:])), live  # no overlap
        for i, r in enumerate(readers):  # each reader drains a random part, in random order
            rng.shuffle(pending[i])
            for h in pending[i][:rng.randint(0, len(pending[i]))]:
                _assert_same(r.get(h), originals[h.key])
                pending[i].remove(h)
    assert writer.evictions > 20 and writer.hits > 20 and stored > 300
    for r in readers:
        r.close()
    writer.close()


def test_attach_errors_and_close_cleanup():
    writer = SharedMemoryObjectStore(8 * KiB, num_readers=1)
    name = writer.name
    with pytest.raises(ValueError, match="out of range"):
        SharedMemoryObjectStore.attach(name, 1)
    reader = SharedMemoryObjectStore.attach(name, 0)
    with pytest.raises(RuntimeError, match="held by live process"):
        SharedMemoryObjectStore.attach(name, 0)
    with pytest.raises(RuntimeError, match="writer's call"):
        reader.put("a", {"x": torch.zeros(1)})
    h = writer.put("a", {"x": torch.arange(4)})
    view = reader.get(h, copy=False)["x"]
    reader.close()  # a live view keeps the mapping: close still succeeds
    assert _exists(name) and torch.equal(view, torch.arange(4))
    with pytest.raises(RuntimeError, match="closed"):
        reader.get(h)
    writer.close()
    assert not _exists(name)
    with pytest.raises(FileNotFoundError):
        SharedMemoryObjectStore.attach(name, 0)
    with pytest.raises(ValueError, match="num_readers"):
        SharedMemoryObjectStore(8 * KiB, num_readers=0)


# ---- other processes ---------------------------------------------------------------------
def _reader_process(name: str, index: int, handles_q, results_q) -> None:
    """Attach as reader `index`; for each batch of handles, read them (copies and zero-copy views in
    turn) and answer (reader, key, pixel digest, aspect ratio) per handle."""
    reader = SharedMemoryObjectStore.attach(name, index)
    while (batch := handles_q.get()) is not None:
        answers = []
        for i, h in enumerate(batch):
            if i % 2:
                obj = reader.get(h)  # a copy: released at once
                answers.append((index, h.key, _digest(obj["pixel_values"]), obj["aspect_ratio"]))
            else:
                obj = reader.get(h, copy=False)
                answers.append((index, h.key, _digest(obj["pixel_values"]), obj["aspect_ratio"]))
                del obj
                reader.release(h)
        results_q.put(answers)
    reader.close()


def test_readers_in_other_processes():
    ctx = mp.get_context("spawn")
    writer = SharedMemoryObjectStore(256 * KiB, num_readers=2)
    handles_qs, results_q = [ctx.Queue(), ctx.Queue()], ctx.Queue()
    procs = [ctx.Process(target=_reader_process, args=(writer.name, i, handles_qs[i], results_q), daemon=True)
             for i in range(2)]
    for p in procs:
        p.start()
    try:
        want = {}
        for batch_no in range(4):  # 4 x 8 objects of ~50 KiB through a 256 KiB ring: only eviction makes room
            batch = []
            for j in range(8):
                key, seed = (f"b{batch_no}i{j}", batch_no * 10 + j) if j < 6 else ("shared", 999)
                h = writer.handle_for(key)
                if h is None:
                    obj = _obj(seed, tiles=4, side=36)
                    h = writer.put(key, obj)
                    want[key] = (_digest(obj["pixel_values"]), obj["aspect_ratio"])
                assert isinstance(h, ShmHandle), (key, h)
                batch.append(h)
            for q in handles_qs:
                q.put(batch)
            got = [results_q.get(timeout=60) for _ in procs]
            for answers in got:
                assert [(key, d, a) for _, key, d, a in answers] == [(h.key, *want[h.key]) for h in batch]
            assert sorted(answers[0][0] for answers in got) == [0, 1]
        assert writer.evictions > 0 and writer.hits >= 4
    finally:
        for q in handles_qs:
            q.put(None)
        for p in procs:
            p.join(30)
        writer.close()
    assert [p.exitcode for p in procs] == [0, 0]
    assert not _exists(writer.name)


def _attach_read_close(name: str, index: int, handle, out_q) -> None:
    reader = SharedMemoryObjectStore.attach(name, index)
    out_q.put(_digest(reader.get(handle)["pixel_values"]))
    reader.close()


_WRITER_SCRIPT = """
import multiprocessing as mp, sys, time, torch
from moe.multimodal.shm_store import SharedMemoryObjectStore
from tests.multimodal.test_shm_store import _attach_read_close, _digest
w = SharedMemoryObjectStore(1 << 16, num_readers=2)
pv = torch.randn(2, 3, 8, 8).to(torch.bfloat16)
h = w.put("a", {"pixel_values": pv})
# a spawned child shares this process's resource tracker: its attach must not unregister the segment
ctx = mp.get_context("spawn"); q = ctx.Queue()
p = ctx.Process(target=_attach_read_close, args=(w.name, 0, h, q)); p.start()
assert q.get(timeout=60) == _digest(pv); p.join(); assert p.exitcode == 0
import msgpack
print(w.name, msgpack.packb(h).hex(), _digest(pv), flush=True)
time.sleep(120)
"""

_READER_SCRIPT = """
import sys, msgpack
from moe.multimodal.shm_store import SharedMemoryObjectStore
from tests.multimodal.test_shm_store import _digest
r = SharedMemoryObjectStore.attach(sys.argv[1], 1)
h = msgpack.unpackb(bytes.fromhex(sys.argv[2]), raw=False)
print(_digest(r.get(h)["pixel_values"]))
r.close()
"""


def test_reader_exit_keeps_segment_and_sigkilled_writer_leaves_nothing():
    writer = subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = writer.stdout.readline().split()
        assert len(line) == 3, writer.stderr.read() if writer.poll() is not None else line
        name, handle_hex, digest = line
        assert _exists(name)
        # a reader with its own resource tracker: communicate() returns once that tracker exited too
        # (it inherits the pipes), so a wrong registration would have unlinked the segment by then
        reader = subprocess.run([sys.executable, "-c", _READER_SCRIPT, name, handle_hex], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert reader.returncode == 0, reader.stderr
        assert reader.stdout.split() == [digest]
        assert "resource_tracker" not in reader.stderr, reader.stderr
        assert _exists(name)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    deadline = time.monotonic() + 10
    while _exists(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _exists(name), "the killed writer's segment is still in /dev/shm"
