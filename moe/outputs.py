"""Result objects, shaped like vLLM's (`RequestOutput`, `CompletionOutput`, `Logprob`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None           # 1 = most likely token
    decoded_token: str | None = None


# Per generated token: token id -> Logprob (the sampled token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error" (a failed step)
    stop_reason: int | str | None = None
    # enable_return_routed_experts, on a finished sequence: the logical experts each MoE layer's router
    # chose for every forwarded token (the prompt and all generated tokens but the last), int16
    # numpy [num_forwarded_tokens, num_moe_layers, top_k]; None otherwise.
    routed_experts: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # why the engine finished it with finish_reason "error"
