"""Least-loaded routing over engine cores, and which layouts get a core per replica."""
from __future__ import annotations

from moe.config import EngineArgs
from moe.engine.core import SchedulerStats
from moe.engine.core_client import core_layout
from moe.entrypoints.serve.async_llm import AsyncLLM


def _router(num_cores: int) -> AsyncLLM:
    engine = object.__new__(AsyncLLM)  # the routing state only: no model, no processes
    engine._core_stats = [SchedulerStats() for _ in range(num_cores)]
    engine._sent_since_stats = [0] * num_cores
    return engine


def test_new_requests_go_to_the_least_loaded_core():
    r = _router(3)
    assert [r._pick_core(1) for _ in range(6)] == [0, 1, 2, 0, 1, 2]  # a burst is dealt round-robin
    r._aggregate_stats(0, SchedulerStats(num_running=5, num_waiting=4))  # core 0 reports other servers' load
    r._aggregate_stats(1, SchedulerStats(num_running=1))
    r._aggregate_stats(2, SchedulerStats(num_running=2, num_waiting=1))
    assert r._pick_core(2) == 1  # n=2: two sequences count
    assert r._pick_core(1) == 1  # core 1 now at 1 + 2 = 3, as core 2: a tie goes to the lower index
    assert r._pick_core(1) == 2  # core 1 at 4
    assert r._sent_since_stats == [0, 3, 1]


def test_one_core_per_replica_unless_expert_parallel():
    count, core_args = core_layout(EngineArgs(model="m", data_parallel_size=4))
    assert count == 4 and core_args.data_parallel_size == 1
    count, core_args = core_layout(EngineArgs(model="m", data_parallel_size=4, enable_expert_parallel=True))
    assert count == 1 and core_args.data_parallel_size == 4
    assert core_layout(EngineArgs(model="m"))[0] == 1
