"""Errors the engine reports about one request, as opposed to the whole engine.

`StepFailure` is what a model runner raises when it can tell which requests of a step broke it
(e.g. one request's sampling parameters): the engine then finishes exactly those with an error
and the rest of the batch goes on. Any other exception from a step is isolated by the engine
itself (moe/engine/llm_engine.py, `LLMEngine._recover_from_failed_step`).

`RequestFailed` is what `LLM.generate` raises for a prompt whose request the engine finished with
`finish_reason="error"`.
"""
from __future__ import annotations


class StepFailure(RuntimeError):
    """A step failed because of the named requests (their ids as the scheduler knows them)."""

    def __init__(self, message: str, request_ids) -> None:
        super().__init__(message)
        self.request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)


class RequestFailed(RuntimeError):
    """The engine finished a request with an error (a step that ran it failed)."""

    def __init__(self, request_id: str, error: str) -> None:
        super().__init__(f"request {request_id!r} failed in the engine: {error}")
        self.request_id = request_id
        self.error = error
