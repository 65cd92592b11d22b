"""Choosing and building a dispatcher: `make_dispatcher` and the rule behind backend "auto".

The `auto` rule (bytes per rank, the quantity that dominates at the sizes that matter):
  * EP size 1 -> "local" (nothing to move).
  * all-gather + reduce-scatter moves every token to all P ranks and every partial result back:
    P copies per token, whatever the routing.
  * all-to-all moves each token to the m distinct ranks its top-k experts live on: m copies.
    m is the caller's hint `expected_ranks_per_token` (e.g. DeepSeek-V3 group-limited routing
    with one expert group per rank: m <= topk_group), else its expectation under uniform routing
    of k distinct experts among E, E/P per rank:  m = P * (1 - C(E - E/P, k) / C(E, k)).
  * pick "all_to_all" when m / P <= AUTO_A2A_MAX_BYTES_RATIO, else "allgather_reducescatter".
    The margin pays for what all-to-all adds (the permutation, index_add_, smaller messages):
    at m/P ~ 1 (EP=2, top-8 of 256) it can at best tie all-gather (BENCHMARKS.md §3).
Examples: EP=2, top-8/256 -> m/P 0.996 -> all-gather; EP=8, top-8/256 -> 0.66 -> all-to-all;
EP=2, top-1 (Llama-4) -> 0.5 -> all-to-all. The threshold is to be recalibrated with
`moe bench all2all` (moe/bench/all2all.py) on the target GPUs.

On CUDA (an NCCL group) "auto" is "low_latency" with that backend as its fallback: a call whose
every rank fits the capacity (decode) moves fixed-size buffers without a host sync, so decode
steps replay CUDA graphs under expert parallelism (on two H200s a DP=2 + EP decode step at 256
requests took 20 ms with graphs against 110-122 ms eagerly, BENCHMARKS.md §3); larger calls
(prefill) take the bytes rule's backend. `low_latency_for_auto` says where this applies.
"""
from __future__ import annotations

from math import comb

import torch.distributed as dist

from all2all.allgather_reducescatter import AllGatherReduceScatterDispatcher
from all2all.all_to_all import AllToAllDispatcher
from all2all.base import Dispatcher, group_size_and_rank
from all2all.local import LocalDispatcher
from all2all.low_latency import LowLatencyDispatcher

# "low_latency" (fixed capacity, no host sync, CUDA-graph capturable) is only used when named.
DISPATCHER_BACKENDS = ("local", "allgather_reducescatter", "all_to_all", "low_latency", "auto")
AUTO_A2A_MAX_BYTES_RATIO = 0.75

_CLASSES: dict[str, type[Dispatcher]] = {
    "local": LocalDispatcher,
    "allgather_reducescatter": AllGatherReduceScatterDispatcher,
    "all_to_all": AllToAllDispatcher,
    "low_latency": LowLatencyDispatcher,
}


def expected_distinct_ranks(num_experts: int, ep_size: int, top_k: int) -> float:
    """Expected number of distinct ranks hit by k distinct uniformly drawn experts (E/P per rank)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    per_rank = num_experts // ep_size
    miss = comb(num_experts - per_rank, top_k) / comb(num_experts, top_k)
    return ep_size * (1.0 - miss)


def choose_backend(ep_size: int, num_experts: int, top_k: int | None = None,
                   expected_ranks_per_token: float | None = None) -> str:
    """The concrete backend that "auto" stands for (see the module docstring for the rule)."""
    if ep_size == 1:
        return "local"
    if expected_ranks_per_token is None:
        if top_k is None:
            raise ValueError("backend 'auto' needs top_k (uniform-routing estimate) or "
                             "expected_ranks_per_token (a routing hint) to choose a dispatcher")
        expected_ranks_per_token = expected_distinct_ranks(num_experts, ep_size, top_k)
    if not 0 < expected_ranks_per_token <= ep_size:
        raise ValueError(f"expected_ranks_per_token must be in (0, {ep_size}], got {expected_ranks_per_token}")
    ratio = expected_ranks_per_token / ep_size
    return "all_to_all" if ratio <= AUTO_A2A_MAX_BYTES_RATIO else "allgather_reducescatter"


def low_latency_for_auto(device_type: str) -> bool:
    """Whether "auto" means "low_latency" (with the bytes rule's fallback) on this device: on CUDA,
    where its fixed shapes let decode steps replay CUDA graphs; the CPU (gloo) keeps the bytes rule."""
    return device_type == "cuda"


def make_dispatcher(backend: str, group: dist.ProcessGroup | None, num_experts: int,
                    placement: str = "linear", *, top_k: int | None = None,
                    expected_ranks_per_token: float | None = None,
                    capacity: int | None = None, auto_low_latency: bool | None = None) -> Dispatcher:
    """Build the dispatcher of one EP group.

    Args:
        backend: one of DISPATCHER_BACKENDS; "auto" applies `choose_backend`.
        group: the EP process group (None = default group; a single process if torch.distributed
            is not initialised). Every rank of it must build the same dispatcher.
        num_experts: global expert count E, divisible by the group size.
        placement: "linear" or "round_robin" expert placement (routing.placement).
        top_k, expected_ranks_per_token: inputs of the "auto" rule, ignored otherwise.
        capacity: rows per destination of "low_latency" (all2all/low_latency.py: T <= capacity
            on every rank); None = its default. Ignored by the other backends.
        auto_low_latency: whether "auto" (at EP > 1) builds "low_latency" with the bytes rule's
            backend as its fallback; None = `low_latency_for_auto` of the group's device (NCCL: CUDA).
    Raises:
        ValueError: unknown backend (the message lists the choices), "local" on a group of more
            than one rank, bad placement or divisibility.
    """
    if backend not in DISPATCHER_BACKENDS:
        raise ValueError(f"unknown dispatcher backend {backend!r}; choose one of {DISPATCHER_BACKENDS}")
    if backend == "auto":
        ep_size, _ = group_size_and_rank(group)
        backend = choose_backend(ep_size, num_experts, top_k, expected_ranks_per_token)
        if auto_low_latency is None:
            auto_low_latency = ep_size > 1 and low_latency_for_auto(
                "cuda" if dist.get_backend(group) == "nccl" else "cpu")
        if auto_low_latency and backend != "local":
            return LowLatencyDispatcher(group, num_experts, placement, capacity=capacity, fallback=backend)
    if backend == "low_latency":
        return LowLatencyDispatcher(group, num_experts, placement, capacity=capacity)
    return _CLASSES[backend](group, num_experts, placement)
