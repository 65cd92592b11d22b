"""The IPC cache of processed images between an API process and an engine core (vLLM's
mm_processor_cache_type "lru"): the API side remembers which images' pixels the core holds and
sends those as their hash alone; the core side keeps the pixels. One pair per (API process, engine
core) connection, both sized by mm_processor_cache_gb; moe/multimodal/processor_cache.py has the
lockstep rules."""
from __future__ import annotations

from moe.config import EngineArgs
from moe.multimodal.processor_cache import ReceiverCache, SenderCache, capacity_from_gb


def _ipc_capacity(args: EngineArgs) -> int:
    if args.mm_processor_cache_type != "lru":
        return 0
    return capacity_from_gb(args.mm_processor_cache_gb)


def ipc_sender_cache(args: EngineArgs) -> SenderCache | None:
    capacity = _ipc_capacity(args)
    return SenderCache(capacity) if capacity else None


def ipc_receiver_cache(args: EngineArgs) -> ReceiverCache | None:
    capacity = _ipc_capacity(args)
    return ReceiverCache(capacity) if capacity else None
