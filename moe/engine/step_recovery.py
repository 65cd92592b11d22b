"""Keeping the engine consistent when a step fails (in-process executor).

A step that raises has already advanced the scheduler: its requests count the step's tokens as
computed, blocks were allocated (and the full ones registered in the prefix cache) for KV that
was never written, and the runner may hold half-updated state. Left so, the requests never get
scheduled again and the engine spins forever. `StepRecovery` undoes the step and decides whom
to blame:

* Rollback: every request of the failed batch goes back to the front of the waiting queue with
  its blocks freed and nothing computed (it is recomputed from its tokens, as after a RECOMPUTE
  preemption: greedy and seeded outputs are unchanged); the prefix cache forgets the free blocks
  (some hold KV that was never written); the runner is told to drop its state of those requests
  through the next SchedulerOutput's `finished_req_ids`, so they reach it as new requests.
* Blame: the requests the exception names (`moe.errors.StepFailure.request_ids`); else the
  batch's only request, or its only request that has never completed a step; else the suspects
  run one at a time (the others are held back and released one per good step) until a step that
  fails has a single suspect. A request in three failed steps in a row is blamed outright.

The engine finishes the blamed requests with `finish_reason="error"`; everything else goes on.
"""
from __future__ import annotations

from collections import Counter

from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

_MAX_FAILED_STEPS = 3


class StepRecovery:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.proven: set[str] = set()       # requests that completed a step since they last failed
        self.held: list[Request] = []       # suspects kept out of the scheduler for now
        self._failed_steps: Counter[str] = Counter()

    @property
    def num_held(self) -> int:
        return len(self.held)

    def on_success(self, so: SchedulerOutput) -> None:
        batch = so.num_scheduled_tokens
        self.proven.update(batch)
        if self._failed_steps:  # only after a failed step
            for req_id in batch:
                self._failed_steps.pop(req_id, None)
        if self.held:
            self._release(self.held[:1])

    def on_failure(self, so: SchedulerOutput, exc: BaseException) -> list[str]:
        """Undo the step; the request ids to finish with an error (possibly none yet)."""
        batch = list(so.num_scheduled_tokens)
        self._rollback(so)
        named = [r for r in getattr(exc, "request_ids", None) or [] if r in self.scheduler.requests]
        if named:
            return named
        self._failed_steps.update(batch)
        repeated = [r for r in batch if self._failed_steps[r] >= _MAX_FAILED_STEPS]
        if repeated:
            return repeated
        suspects = [r for r in batch if r not in self.proven] or batch
        if len(suspects) == 1:
            return suspects
        # Cannot tell yet: run the suspects one at a time.
        self.proven.difference_update(suspects)
        requests = self.scheduler.requests
        hold = {r for r in suspects[1:]}
        self.held.extend(requests[r] for r in suspects[1:])
        self.scheduler.waiting = type(self.scheduler.waiting)(
            r for r in self.scheduler.waiting if r.request_id not in hold)
        return []

    def forget(self, request_ids) -> None:
        """Requests leaving the engine (finished or aborted); held ones rejoin the scheduler
        first, so that it can finish them."""
        ids = set(request_ids)
        self._release([r for r in self.held if r.request_id in ids])
        self.proven.difference_update(ids)
        for r in ids:
            self._failed_steps.pop(r, None)

    def _release(self, requests: list[Request]) -> None:
        for request in reversed(requests):
            self.held.remove(request)
            self.scheduler.waiting.appendleft(request)

    def rollback(self, so: SchedulerOutput) -> None:
        """Undo a step without blaming anyone (async scheduling: the step queued behind a failed one)."""
        self._rollback(so)

    def _rollback(self, so: SchedulerOutput) -> None:
        s = self.scheduler
        ids = set(so.num_scheduled_tokens)
        back = [r for r in s.running if r.request_id in ids]
        s.running[:] = [r for r in s.running if r.request_id not in ids]
        for request in back:
            s.free_resources(request)
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.status = RequestStatus.WAITING
            s._runner_knows.discard(request.request_id)
        s.waiting.extendleft(reversed(back))
        # Free blocks of this step hold KV that was never written: no later request may hit them.
        s.kv.reset_prefix_cache()
        # The runner drops its (possibly half-updated) state of these requests at the next step,
        # and of the finished ones it may not have seen.
        s._finished_since_last_step |= ids | set(so.finished_req_ids) | set(so.preempted_req_ids)
