"""The scheduler's two rules for structured outputs: a request whose grammar is compiling
(WAITING_FOR_FSM) lets the others pass and keeps its place, and under async scheduling a
structured request is not scheduled while a token of it is in flight (its next mask needs it)."""
from __future__ import annotations

from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from tests.scheduler.factories import make_scheduler


def test_a_compiling_request_is_passed_over_and_keeps_its_place():
    s = make_scheduler()
    a, b, c = Request("a", [1, 2, 3], 4), Request("b", [4, 5], 4), Request("c", [6], 4)
    b.status = RequestStatus.WAITING_FOR_FSM
    for r in (a, b, c):
        s.add_request(r)
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["a", "c"]
    assert [r.request_id for r in s.waiting] == ["b"] and b.status == RequestStatus.WAITING_FOR_FSM
    b.status = RequestStatus.WAITING  # its grammar is ready
    s.update_from_output(so, {"a": [7], "c": [8]})
    assert "b" in s.schedule().num_scheduled_tokens
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)  # a compiling request can be aborted too
    assert not s.waiting


def test_a_structured_request_skips_the_step_behind_its_token_in_flight():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                  num_blocks=32, async_scheduling=True))
    s.add_request(Request("plain", [1, 2, 3], 8))
    s.add_request(Request("json", [4, 5, 6], 8, use_structured_output=True))
    first = s.schedule()
    assert set(first.num_scheduled_tokens) == {"plain", "json"}
    second = s.schedule()  # the first step's tokens are still in flight
    assert list(second.num_scheduled_tokens) == ["plain"]
    s.update_from_output(first, {"plain": [9], "json": [10]})
    third = s.schedule()
    assert set(third.num_scheduled_tokens) == {"json", "plain"}
    assert s.requests["json"].num_output_placeholders == 1
