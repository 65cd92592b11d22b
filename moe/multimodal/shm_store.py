"""A shared-memory object store for processed multimodal inputs (mm_processor_cache_type="shm").

One writer (the API process) serialises objects (a dict of named tensors + small JSON-able
metadata) into a ring buffer in one POSIX shared-memory segment and sends small handles over IPC;
every reader (worker process) attaches to the segment by name and reads the objects directly.

Segment layout (int64 words; everything 64-byte aligned):
    control block   [magic, version, num_readers, capacity, data_offset, writer_pid, 0, 0,
                     reader_pid[0..R)]                    (a reader claims its slot on attach)
    data ring       objects, each never wrapping: [object header | metadata JSON | tensor bytes ...]
    object header   [magic, seq, size, meta_len, read_count[0..R)]

Reader bookkeeping without locks: each object header holds one read counter per reader, written
only by that reader (an aligned 8-byte store; the writer only reads them). The writer counts, in its
own memory, the references it has issued for each object (put + each hit of handle_for). An object
may be evicted only when every reader's counter has reached the issued count, i.e. every reader
has finished with every handle of it. Eviction is FIFO: the writer frees the oldest objects while
they are finished; if the oldest is still in use, put returns Refused.FULL and the caller sends the
object inline.

What the callers must guarantee (the ordering/usage assumptions):
  * exactly once per reader per handle: every reader calls get(h) (copy, counts at once) or
    get(h, copy=False) then release(h), or only release(h) for a handle it will not read, once for
    every handle the writer returned (a put or a handle_for hit). Readers may do so in ANY order (no
    sequence order is assumed), but a handle that never reaches a reader (a request aborted between
    the writer and the workers) pins its object, and FIFO eviction stops at it: deliver such handles
    to the readers as release-only. A reader that consumes a handle twice frees the object early.
  * a handle is sent to readers after put/handle_for returned (the IPC send orders the writes).
  * one writer thread (the writer's bookkeeping is not locked).
  * the readers' loads of an object come before their counter store in program order; x86 keeps
    that order (stores are not reordered before earlier loads).
The number of readers is fixed at creation. The writer unlinks the segment on close(); a writer
killed by SIGKILL leaves it to the multiprocessing resource tracker of the writer's process tree,
which unlinks it when every process sharing that tracker has exited. Readers never register the
segment with a resource tracker, so a reader's exit never unlinks it. When the whole tree is killed
(tracker too), reclaim_stale_segments() removes what is left: the writer and the counting readers
hold a shared flock on the segment while attached, so a segment nobody holds (and whose writer pid,
in its name, is gone) is garbage.

No SIGBUS: a tmpfs page is allocated when first touched, and a write to a page that a full /dev/shm
cannot supply kills the writer with SIGBUS. The writer therefore reserves (posix_fallocate) the bytes
of an object before writing them; a reservation that fails (ENOSPC) is Refused.NO_SPACE, and the
object travels inline. The ring is filled from offset 0 up, so the reserved bytes are one prefix.
"""
from __future__ import annotations

import enum
import errno
import fcntl
import json
import logging
import os
import re
import sys
import threading
from collections import deque
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, NamedTuple

import numpy as np
import torch

logger = logging.getLogger("moe.multimodal")

_ALIGN = 64
_SEGMENT_MAGIC = 0x4D4F454D4D534831  # "MOEMMSH1"
_OBJECT_MAGIC = 0x4D4F454F424A4543  # "MOEOBJEC"
_VERSION = 1
_CONTROL_WORDS = 8  # words before the reader pid slots
_OBJECT_WORDS = 4  # words before the read counters
DEFAULT_MAX_OBJECT_BYTES = 128 << 20  # vLLM's mm_shm_cache_max_object_size_mb default (128)


def _round_up(n: int, align: int = _ALIGN) -> int:
    return (n + align - 1) // align * align


class Refused(str, enum.Enum):
    """Why put stored nothing (send the object inline instead)."""
    FULL = "full"  # no room: the oldest objects are still being read
    TOO_LARGE = "too_large"  # bigger than max_object_bytes
    NO_SPACE = "no_space"  # /dev/shm cannot supply the pages (full since the store was made)


class StaleHandleError(RuntimeError):
    """The handle's object is no longer at its offset (evicted: a handle consumed after its release)."""


class TensorSpec(NamedTuple):
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple
    offset: int  # bytes from the object's start
    nbytes: int


class ShmHandle(NamedTuple):
    """What travels over IPC instead of the object (a tuple: pickles, and msgpacks as an array)."""
    key: str
    offset: int  # of the object in the data ring
    size: int  # bytes the object occupies in the ring
    seq: int  # the object's put number: checked against the header on read
    tensors: tuple  # TensorSpec per tensor

    @classmethod
    def of(cls, h: Any) -> "ShmHandle":
        """A handle, from itself or from its msgpack form (nested lists)."""
        if isinstance(h, ShmHandle):
            return h
        key, offset, size, seq, tensors = h
        return cls(key, offset, size, seq,
                   tuple(TensorSpec(n, d, tuple(s), o, b) for n, d, s, o, b in tensors))


@dataclass
class _Entry:
    handle: ShmHandle
    issued: int  # references handed out (put + handle_for hits)

    @property
    def end(self) -> int:
        return self.handle.offset + self.handle.size


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a shared-memory handle")
    return dtype


_ATTACH_LOCK = threading.Lock()
_MAPPINGS_KEPT_FOR_VIEWS: list = []  # mmaps closed while zero-copy views were alive (see close)


def _attach_untracked(name: str) -> SharedMemory:
    """Open an existing segment without registering it with this process's resource tracker (the
    tracker would unlink the writer's segment when this reader exits, or, if the tracker is shared
    with the writer, an unregister here would drop the writer's registration)."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    with _ATTACH_LOCK:
        register = resource_tracker.register

        def register_others(rname, rtype):  # other threads' semaphores etc. still register
            if rtype != "shared_memory":
                register(rname, rtype)

        resource_tracker.register = register_others
        try:
            return SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _check_shm_space(size: int) -> None:
    """A segment larger than /dev/shm's free space is created fine but kills the writer with SIGBUS
    when a write first touches a missing page: refuse it up front (containers often mount 64 MB)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:  # no /dev/shm (not Linux): nothing to check
        return
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise ValueError(f"shared-memory store of {size / 2**20:.1f} MiB does not fit in /dev/shm "
                         f"({free / 2**20:.1f} MiB free): lower the capacity or enlarge /dev/shm "
                         f"(docker run --shm-size)")


def _reserve(shm: SharedMemory, offset: int, length: int) -> None:
    """Allocate the segment's pages for [offset, offset + length) now, so that writing them cannot
    SIGBUS; OSError (ENOSPC: /dev/shm is full) if they cannot be had."""
    if length > 0 and hasattr(os, "posix_fallocate"):  # not on macOS (no tmpfs SIGBUS to avoid there)
        os.posix_fallocate(shm._fd, offset, length)


def _hold(shm: SharedMemory) -> None:
    """A shared flock on the segment for as long as this attachment's fd is open (closing it, or
    the process dying, lets go): a flock, unlike a pid, is seen across pid namespaces sharing /dev/shm."""
    fcntl.flock(shm._fd, fcntl.LOCK_SH)


_SHM_DIR = "/dev/shm"


def reclaim_stale_segments(prefix: str, folder: str = _SHM_DIR) -> list[str]:
    """Unlink the segments named <prefix><pid>_<hex> whose writer process is gone and that no
    process holds (no writer or counting reader attached); the names removed. A live store is
    never touched: its writer's pid exists, or its flock is held."""
    removed = []
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    except OSError:  # no /dev/shm: nothing to reclaim
        return removed
    for name in names:
        m = re.fullmatch(re.escape(prefix) + r"(\d+)_[0-9a-f]+", name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live store (perhaps of another pid namespace)
            os.close(fd)
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedMemoryObjectStore:
    """The writer (constructor) or a reader (attach) of one shared-memory object store."""

    def __init__(self, capacity_bytes: int, num_readers: int, max_object_bytes: int | None = None,
                 name: str | None = None) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"shared-memory store capacity must be a positive int of bytes, got {capacity_bytes!r}")
        if not isinstance(num_readers, int) or num_readers < 1:
            raise ValueError(f"shared-memory store needs num_readers >= 1, got {num_readers!r}")
        capacity = _round_up(capacity_bytes)
        if max_object_bytes is None:
            max_object_bytes = min(capacity, DEFAULT_MAX_OBJECT_BYTES)
        if max_object_bytes <= 0:
            raise ValueError(f"max_object_bytes must be > 0, got {max_object_bytes}")
        data_offset = _round_up((_CONTROL_WORDS + num_readers) * 8)
        _check_shm_space(data_offset + capacity)
        shm = SharedMemory(name=name, create=True, size=data_offset + capacity)
        try:
            _reserve(shm, 0, data_offset)  # the control block: written below
        except OSError as exc:
            shm.close()
            shm.unlink()
            raise ValueError(f"cannot allocate the shared-memory store's first page in /dev/shm: {exc}") from None
        _hold(shm)
        self._init_common(shm, writer=True, num_readers=num_readers, capacity=capacity, data_offset=data_offset)
        w = self._words
        w[0:6] = [_SEGMENT_MAGIC, _VERSION, num_readers, capacity, data_offset, os.getpid()]
        w[_CONTROL_WORDS:_CONTROL_WORDS + num_readers] = 0
        self.max_object_bytes = min(max_object_bytes, capacity)
        self._fifo: deque[_Entry] = deque()
        self._by_key: dict[str, _Entry] = {}
        self._next_seq = 1
        self._reserved = 0  # bytes of the data ring [0, _reserved) with their pages allocated
        self.hits = self.queries = self.evictions = self.refused_full = self.refused_too_large = 0
        self.refused_no_space = 0

    def _init_common(self, shm: SharedMemory, writer: bool, num_readers: int, capacity: int,
                     data_offset: int) -> None:
        self._shm = shm
        self.name = shm.name
        self.is_writer = writer
        self.num_readers = num_readers
        self.capacity_bytes = capacity
        self._data_offset = data_offset
        self._words = np.frombuffer(shm.buf, dtype=np.int64)  # every 8-aligned word of the segment
        # Through numpy, so every tensor view holds a buffer export: closing the mapping under live
        # views then fails (BufferError, handled in close) instead of leaving them dangling. Copies go
        # through numpy too: one single-threaded memcpy (torch's copy_ splits large copies over its
        # intra-op threads, which costs milliseconds when the cores are busy).
        self._np_bytes = np.frombuffer(shm.buf, dtype=np.uint8)
        self._bytes = torch.from_numpy(self._np_bytes)
        self._obj_header_bytes = _round_up((_OBJECT_WORDS + num_readers) * 8)
        self.reader_index: int | None = None
        self.observer = False
        self._closed = False

    @classmethod
    def attach(cls, name: str, reader_index: int | None) -> "SharedMemoryObjectStore":
        """A reader of the store `name` (created by a writer), owning read-counter slot `reader_index`;
        None: an observer, which reads (copies only) without counting: some counting reader keeps
        the objects it reads alive (the engine core pins a request's images until it finishes)."""
        shm = _attach_untracked(name)
        head = np.frombuffer(shm.buf, dtype=np.int64, count=_CONTROL_WORDS)
        magic, version, num_readers, capacity, data_offset = (int(x) for x in head[:5])
        del head
        if magic != _SEGMENT_MAGIC or version != _VERSION:
            shm.close()
            raise ValueError(f"shared-memory segment {name!r} is not a moe object store (version {_VERSION})")
        if reader_index is None:
            self = cls.__new__(cls)
            self._init_common(shm, writer=False, num_readers=num_readers, capacity=capacity, data_offset=data_offset)
            self.observer = True
            return self
        if not isinstance(reader_index, int) or not 0 <= reader_index < num_readers:
            shm.close()
            raise ValueError(f"reader_index {reader_index!r} out of range: store {name!r} has {num_readers} readers")
        self = cls.__new__(cls)
        self._init_common(shm, writer=False, num_readers=num_readers, capacity=capacity, data_offset=data_offset)
        slot = _CONTROL_WORDS + reader_index
        holder = int(self._words[slot])
        if holder and _pid_alive(holder):
            self.close()
            raise RuntimeError(f"reader slot {reader_index} of shared-memory store {name!r} is held by live "
                               f"process {holder}: each reader needs its own reader_index")
        self._words[slot] = os.getpid()
        self.reader_index = reader_index
        _hold(shm)  # a counting reader's pins keep the segment alive (see reclaim_stale_segments)
        return self

    # ---- writer ----------------------------------------------------------------------------
    def handle_for(self, key: str) -> ShmHandle | None:
        """A new reference to the stored object of `key` (no new bytes), or None; counts a query/hit."""
        self._check_writer("handle_for")
        self.queries += 1
        entry = self._by_key.get(key)
        if entry is None:
            return None
        self.hits += 1
        entry.issued += 1
        return entry.handle

    def put(self, key: str, obj: dict[str, Any]) -> ShmHandle | Refused:
        """Store `obj` (str -> tensor or JSON-able value) under `key`, evicting the oldest finished
        objects; a handle, or Refused.TOO_LARGE / Refused.FULL (nothing stored: send inline).
        A key already stored is referenced again (same as a handle_for hit, not counted)."""
        self._check_writer("put")
        entry = self._by_key.get(key)
        if entry is not None:
            entry.issued += 1
            return entry.handle
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise TypeError("a shared-memory object must be a dict with str keys (tensors and JSON-able metadata)")
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        meta = {k: v for k, v in obj.items() if not isinstance(v, torch.Tensor)}
        try:
            meta_bytes = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
        except (TypeError, ValueError) as exc:
            raise TypeError(f"non-tensor values of a shared-memory object must be JSON-able "
                            f"(nested tensors are not supported): {exc}") from None
        specs, pos = [], _round_up(self._obj_header_bytes + len(meta_bytes))
        flat = []
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            nbytes = t.numel() * t.element_size()
            specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), pos, nbytes))
            flat.append(t.reshape(-1).view(torch.uint8))
            pos = _round_up(pos + nbytes)
        size = pos
        if size > self.max_object_bytes:
            self.refused_too_large += 1
            return Refused.TOO_LARGE
        offset = self._make_room(size)
        if offset is None:
            self.refused_full += 1
            return Refused.FULL
        if offset + size > self._reserved:
            try:
                _reserve(self._shm, self._data_offset + self._reserved, offset + size - self._reserved)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM) and not self.refused_no_space:
                    logger.warning("cannot reserve shared memory in %s (%s): objects go inline", self.name, exc)
                self.refused_no_space += 1
                return Refused.NO_SPACE
            self._reserved = offset + size
        seq = self._next_seq
        self._next_seq += 1
        base = self._data_offset + offset
        w0 = base // 8
        self._words[w0 + _OBJECT_WORDS:w0 + _OBJECT_WORDS + self.num_readers] = 0
        m0 = base + self._obj_header_bytes
        if meta_bytes:
            self._np_bytes[m0:m0 + len(meta_bytes)] = np.frombuffer(meta_bytes, dtype=np.uint8)
        for spec, src in zip(specs, flat):
            np.copyto(self._np_bytes[base + spec.offset:base + spec.offset + spec.nbytes], src.numpy())
        self._words[w0:w0 + _OBJECT_WORDS] = [_OBJECT_MAGIC, seq, size, len(meta_bytes)]
        handle = ShmHandle(key, offset, size, seq, tuple(specs))
        entry = _Entry(handle, issued=1)
        self._fifo.append(entry)
        self._by_key[key] = entry
        return handle

    def _is_finished(self, entry: _Entry) -> bool:
        w = (self._data_offset + entry.handle.offset) // 8 + _OBJECT_WORDS
        return bool((self._words[w:w + self.num_readers] >= entry.issued).all())

    def _find_spot(self, size: int) -> int | None:
        """A free contiguous range of `size` bytes after the newest object (wrapping to 0), or None."""
        if not self._fifo:
            return 0
        head, tail = self._fifo[0].handle.offset, self._fifo[-1].end
        if tail > head:  # live objects in [head, tail): free space after tail, then before head
            if tail + size <= self.capacity_bytes:
                return tail
            return 0 if size <= head else None
        return tail if tail + size <= head else None  # wrapped: free space is [tail, head)

    def _make_room(self, size: int) -> int | None:
        while (offset := self._find_spot(size)) is None:
            oldest = self._fifo[0]
            if not self._is_finished(oldest):
                return None
            self._fifo.popleft()
            if self._by_key.get(oldest.handle.key) is oldest:
                del self._by_key[oldest.handle.key]
            self._words[(self._data_offset + oldest.handle.offset) // 8] = 0  # stale handles now fail loudly
            self.evictions += 1
        return offset

    @property
    def num_objects(self) -> int:
        return len(self._fifo)

    @property
    def used_bytes(self) -> int:
        return sum(e.handle.size for e in self._fifo)

    def keys(self) -> list[str]:
        """Stored keys, oldest first (the eviction order)."""
        return [e.handle.key for e in self._fifo]

    @property
    def writer_pid(self) -> int:
        return int(self._words[5])

    def reset_counters(self) -> None:
        self.hits = self.queries = self.evictions = self.refused_full = self.refused_too_large = 0
        self.refused_no_space = 0

    # ---- readers ---------------------------------------------------------------------------
    def get(self, handle: ShmHandle | list, copy: bool = True) -> dict[str, Any]:
        """The object of `handle`: metadata plus tensors. copy=True copies the tensors out and, in a
        reader, releases the handle at once; copy=False gives views into the segment, valid until
        release(handle) (which the reader must then call once)."""
        if self._closed:
            raise RuntimeError("shared-memory store is closed")
        h = ShmHandle.of(handle)
        base = self._data_offset + h.offset
        if h.offset < 0 or h.offset % _ALIGN or h.offset + h.size > self.capacity_bytes:
            raise ValueError(f"shared-memory handle out of range: {h}")
        w0 = base // 8
        magic, seq, size, meta_len = (int(x) for x in self._words[w0:w0 + _OBJECT_WORDS])
        if magic != _OBJECT_MAGIC or seq != h.seq or size != h.size:
            raise StaleHandleError(f"object {h.key!r} (seq {h.seq}) is no longer at offset {h.offset} of "
                                   f"{self.name!r}: its handle was used after every reader released it")
        obj: dict[str, Any] = {}
        if meta_len:
            m0 = base + self._obj_header_bytes
            obj.update(json.loads(self._np_bytes[m0:m0 + meta_len].tobytes()))
        for spec in h.tensors:
            start, end = base + spec.offset, base + spec.offset + spec.nbytes
            dtype = _dtype_from_name(spec.dtype)
            if copy:
                out = torch.empty(spec.shape, dtype=dtype)
                np.copyto(out.reshape(-1).view(torch.uint8).numpy(), self._np_bytes[start:end])
            else:
                out = self._bytes[start:end].view(dtype).reshape(spec.shape)
            obj[spec.name] = out
        if copy and not self.is_writer and not self.observer:
            self.release(h)
        elif not copy and self.observer:
            raise RuntimeError("an observer reads copies only (its views would outlive no pin of its own)")
        return obj

    def release(self, handle: ShmHandle | list) -> None:
        """This reader is done with `handle` (after get(copy=False), or to skip a handle unread)."""
        if self.is_writer or self.observer:
            raise RuntimeError("release is a counting reader's call; the writer evicts on its own and observers "
                               "do not count")
        if self._closed:
            raise RuntimeError("shared-memory store is closed")
        h = ShmHandle.of(handle)
        w = (self._data_offset + h.offset) // 8
        if int(self._words[w]) != _OBJECT_MAGIC or int(self._words[w + 1]) != h.seq:
            raise StaleHandleError(f"release of object {h.key!r} (seq {h.seq}): no longer stored "
                                   f"(released more often than handed out)")
        counter = w + _OBJECT_WORDS + self.reader_index
        self._words[counter] = self._words[counter] + 1  # this reader is the counter's only writer

    # ---- lifetime --------------------------------------------------------------------------
    def _check_writer(self, what: str) -> None:
        if not self.is_writer:
            raise RuntimeError(f"{what} is the writer's call; readers only get and release")
        if self._closed:
            raise RuntimeError("shared-memory store is closed")

    def close(self) -> None:
        """Reader: free its slot and unmap. Writer: unlink the segment (readers still attached keep
        their mapping) and unmap. Zero-copy views still alive keep the mapping (not an error)."""
        if self._closed:
            return
        self._closed = True
        if not self.is_writer and self.reader_index is not None:
            self._words[_CONTROL_WORDS + self.reader_index] = 0
        self._words = self._bytes = self._np_bytes = None
        if self.is_writer:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        try:
            self._shm.close()
        except BufferError:
            # Zero-copy views are alive and point into the mapping, which must stay mapped: keep the
            # mmap until the process exits, and take it from SharedMemory so its finaliser does not
            # try to close it again and fail.
            shm = self._shm
            _MAPPINGS_KEPT_FOR_VIEWS.append((shm._buf, shm._mmap))
            shm._buf = shm._mmap = None
            if shm._fd >= 0:
                os.close(shm._fd)
                shm._fd = -1

    def __enter__(self) -> "SharedMemoryObjectStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False and getattr(self, "is_writer", False):
            self.close()
