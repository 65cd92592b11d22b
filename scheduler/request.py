"""A request as the scheduler sees it: token ids, progress, stop conditions and status."""
from __future__ import annotations

import enum
import time
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Waiting for its structured-output grammar to compile (vLLM's name): the scheduler passes it over.
    WAITING_FOR_FSM = "waiting_for_fsm"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
                        RequestStatus.FINISHED_ABORTED)


class FinishReason(str, enum.Enum):
    """The `finish_reason` strings vLLM reports."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One sequence to generate. `sampling_params` is carried opaquely to the model runner.

    Token bookkeeping: `all_token_ids` = prompt + generated; `num_computed_tokens` counts the
    tokens whose KV is (or will be, after the step being scheduled) in the cache. With async
    scheduling, `num_output_placeholders` counts tokens being sampled by steps still in flight:
    the next step already computes their KV, their values arrive later.
    """

    __slots__ = ("request_id", "prompt_token_ids", "num_prompt_tokens", "all_token_ids", "max_tokens",
                 "eos_token_ids", "stop_token_ids", "ignore_eos", "min_tokens", "sampling_params",
                 "arrival_time", "status", "num_computed_tokens", "num_cached_tokens", "num_preemptions",
                 "stop_reason", "block_hashes", "stopping_tokens", "mm_items", "num_output_placeholders",
                 "skip_reading_prefix_cache", "use_structured_output", "max_num_tokens")

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        eos_token_ids: tuple[int, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        sampling_params: Any = None,
        arrival_time: float | None = None,
        mm_items: list | tuple = (),
        skip_reading_prefix_cache: bool = False,
        use_structured_output: bool = False,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.max_tokens = max_tokens
        # The length at which it ends: max_tokens outputs (the scheduler also caps it at max_model_len).
        self.max_num_tokens = self.num_prompt_tokens + max_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_token_ids = tuple(stop_token_ids)
        self.ignore_eos = ignore_eos
        self.min_tokens = min_tokens
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Chained hashes of the request's full blocks, grown as tokens arrive (prefix caching).
        self.block_hashes: list[int] = []
        # Every token that can end the request (EOS unless ignored, plus stop_token_ids).
        self.stopping_tokens = frozenset(self.stop_token_ids + (() if ignore_eos else self.eos_token_ids))
        # Images of the prompt in order (moe/multimodal/inputs.py's ImageItem): their spans and
        # hashes steer the encoder budget and the prefix-cache keys; the runner gets the pixels.
        self.mm_items = mm_items
        # Compute the whole prompt even where the prefix cache holds it (vLLM's name): a request
        # that asks for prompt logprobs needs the logits of every prompt position. Its blocks
        # are still registered for others to hit.
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        # Its tokens are constrained by a grammar (the engine core's StructuredOutputManager): each
        # step's mask needs the previous token, so with async scheduling it is not scheduled while
        # a token of it is in flight.
        self.use_structured_output = use_structured_output

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
