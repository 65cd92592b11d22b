"""Data parallelism on the engine side: N engine cores, each with its own scheduler and KV cache
(one per DP replica), behind the one-scheduler interface the engine uses.

New requests go to the replica with the fewest unfinished requests (ties: the lowest index), so
a batch of prompts is dealt round-robin and later arrivals fill the least busy replica. Every
step schedules every replica; the executor runs them side by side (an idle replica runs a dummy
batch when the MoE collectives span replicas) and they all stop when none has work left.
"""
from __future__ import annotations

from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from scheduler.output import EngineCoreOutput


class _KVView:
    """Aggregated KV statistics of the replicas (what metrics and the LLM read)."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self._schedulers = schedulers

    def usage(self) -> float:
        return sum(s.kv.usage() for s in self._schedulers) / len(self._schedulers)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(s.kv.prefix_cache_queries for s in self._schedulers)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(s.kv.prefix_cache_hits for s in self._schedulers)

    @property
    def num_blocks(self) -> int:
        return sum(s.kv.num_blocks for s in self._schedulers)

    def reset_prefix_cache(self) -> bool:
        return all([s.kv.reset_prefix_cache() is not False for s in self._schedulers])


class DataParallelScheduler:
    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers
        self.kv = _KVView(schedulers)
        self._owner: dict[str, int] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id in self._owner:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        loads = [s.num_running + s.num_waiting for s in self.schedulers]
        d = loads.index(min(loads))
        self.schedulers[d].add_request(request)
        self._owner[request.request_id] = d

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            d = self._owner.pop(rid, None)
            if d is not None:
                self.schedulers[d].finish_requests(rid, status)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.schedulers)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.schedulers)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    def schedule(self) -> list[SchedulerOutput]:
        return [s.schedule() for s in self.schedulers]

    def update_from_output(self, scheduler_outputs: list[SchedulerOutput], runner_outputs) -> list[EngineCoreOutput]:
        core: list[EngineCoreOutput] = []
        for sched, so, out in zip(self.schedulers, scheduler_outputs, runner_outputs):
            for co in out.attach_prompt_logprobs(sched.update_from_output(so, out.sampled, out.logprobs)):
                if co.finished:
                    self._owner.pop(co.req_id, None)
                core.append(co)
        return core
