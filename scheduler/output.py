"""What the scheduler hands to the executor each step, and what comes back per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    """A request the model runner has not seen (or has dropped after a preemption)."""
    req_id: str
    token_ids: list[int]          # prompt + tokens generated so far (recomputed after preemption)
    num_prompt_tokens: int
    sampling_params: Any
    block_ids: list[list[int]]    # one list per KV-cache group (group 0 = full attention)
    num_computed_tokens: int      # tokens already in the KV cache (prefix-cache hits) before this step
    mm_items: list | tuple = ()   # the prompt's images (moe/multimodal/inputs.py's ImageItem), in order


@dataclass
class CachedRequestData:
    """The requests the runner already tracks, as parallel lists: only new blocks travel.

    One object per step rather than one per request keeps a 256-request decode step cheap.
    """
    req_ids: list[str] = field(default_factory=list)
    # Per request, one list of new block ids per KV-cache group; () when no group added a block.
    new_block_ids: list = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's plan. The batch order is the order of `num_scheduled_tokens`."""
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests finished or aborted since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    # Images whose encoder features the runner computes this step: request id -> item indices.
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # Encoder features the runner drops before the step (their tokens are all computed).
    free_encoder_inputs: list[tuple[str, int]] = field(default_factory=list)
    # Structured outputs (filled by the engine core after scheduling): the requests whose sampled
    # token is constrained this step, and their allowed tokens, one row each in that order: an
    # int32 numpy array [rows, ceil(V / 32)], bit t % 32 of word t // 32 set = token t allowed.
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # Async scheduling: structured requests of this step whose previous token is still in flight;
    # their rows are added (StructuredOutputManager.fill_deferred) before the step samples.
    deferred_grammar_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request after a step, with its finish state."""
    req_id: str
    new_token_ids: list[int]
    new_logprobs: Any = None      # per new token, opaque to the scheduler
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: Any = None   # with the first new token of a request that asked, opaque to the scheduler
    # Finished ("stop") because its structured-output grammar is complete: the last token is text,
    # not a stop token (EOS / stop_token_ids) whose text the output leaves out.
    stopped_by_grammar: bool = False
    # enable_return_routed_experts: the request's routed expert ids [n, L, K] int16 of positions
    # [routed_experts_start, routed_experts_start + n) written since its last output (moe/engine/routed_experts.py).
    routed_experts: Any = None
    routed_experts_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
