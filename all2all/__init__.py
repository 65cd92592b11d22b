"""Token dispatchers for expert parallelism: the protocol (`Dispatcher`, `DispatchResult`) and
its backends `local`, `allgather_reducescatter`, `all_to_all`, `low_latency`, built by `make_dispatcher`."""
from all2all.allgather_reducescatter import AllGatherReduceScatterDispatcher
from all2all.all_to_all import AllToAllDispatcher
from all2all.base import DispatchResult, Dispatcher
from all2all.factory import (
    AUTO_A2A_MAX_BYTES_RATIO,
    DISPATCHER_BACKENDS,
    choose_backend,
    expected_distinct_ranks,
    low_latency_for_auto,
    make_dispatcher,
)
from all2all.local import LocalDispatcher
from all2all.low_latency import LowLatencyDispatcher

__all__ = [
    "DispatchResult", "Dispatcher", "LocalDispatcher", "AllGatherReduceScatterDispatcher",
    "AllToAllDispatcher", "LowLatencyDispatcher", "make_dispatcher", "choose_backend", "expected_distinct_ranks",
    "DISPATCHER_BACKENDS", "AUTO_A2A_MAX_BYTES_RATIO", "low_latency_for_auto",
]
