"""The start-up heap kept out of Python's cyclic garbage collector.

A full (oldest-generation) collection walks every tracked object: after start-up that is the
imported libraries, the model's modules, the tokenizer and the captured graphs, a few hundred
thousand objects, so a collection that lands mid-serving stalls one step by ~0.1 s (the tiny
model on the CPU: 93-122 ms, against 3 ms frozen; benchmarks/gc_pauses_cpu.py). Once an engine has
started, what is alive stays alive for its lifetime: it is collected once and then frozen
(`gc.freeze`), so later collections only walk the objects the requests make. vLLM's engine
does the same after start-up.

`MOE_GC_FREEZE=0` leaves the collector as it is.
"""
from __future__ import annotations

import atexit
import gc
import os


def gc_freeze_enabled() -> bool:
    return os.environ.get("MOE_GC_FREEZE", "1") != "0"


def freeze_startup_heap() -> None:
    """Collect what start-up left behind, then freeze every surviving object (call once the
    engine or worker is built). Objects frozen by an earlier engine stay frozen: they are not
    walked again."""
    if gc_freeze_enabled():
        gc.collect()
        gc.freeze()
        # Back to the collector before the interpreter's last collection, so extension types
        # (Triton's nanobind objects) are finalised, not reported as leaked.
        atexit.unregister(release_frozen_heap)
        atexit.register(release_frozen_heap)


def release_frozen_heap() -> None:
    """Hand the frozen objects back to the collector (at shutdown), so the reference cycles of
    a closed engine are collected like any others."""
    if gc.get_freeze_count():
        gc.unfreeze()
