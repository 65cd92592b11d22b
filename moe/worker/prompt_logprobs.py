"""Prompt logprobs (SamplingParams.prompt_logprobs) on the model runner's side.

Prompt token j (j >= 1) is scored by the logits at position j - 1, so a step that computes prompt
positions c .. c+n-1 of a request scores its tokens c+1 .. min(c+n, P-1) (P prompt tokens; the
logits at position P-1 sample the first output token and score nothing of the prompt). Only those
rows of the step's hidden states go through the lm_head, in sub-chunks of at most CHUNK_ELEMENTS
logits, each log-softmaxed in float32 and reduced to the scored token's logprob and rank and the
top-k before the next: a long prompt never holds [P, V] floats at once, and a step without such a
request does none of this (one set lookup).

The results stay on the device, a chunk per step, in the request's RequestState until its last
prompt chunk. That step samples the request's first token, and the whole prompt's results are
copied to the host with the step's sampled tokens (PendingStep): no step waits for the device
because of them. They reach the output side with that first token. A request preempted or rolled
back before it loses its runner state and its chunks with it; computed again from position 0, its
prompt is scored again. One whose first token was accepted comes back with output tokens and is
not scored again (its prompt logprobs were delivered).

The prompt must be computed from position 0: the scheduler skips prefix-cache reads for these
requests (Request.skip_reading_prefix_cache). Were it not, the tokens before the first computed
position would have no entry (None, as the first token).

Every rank of the last pipeline stage runs the lm_head on the same rows (a TP collective); only
the driver rank keeps the results.

Legend: T tokens of the step, D hidden size, R scored rows, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.host_to_device import host_to_device
from moe.worker.sampler import token_logprobs
from moe.worker.step_inputs import RequestState, StepBatch

# Logits per lm_head call when scoring prompt tokens (rows = CHUNK_ELEMENTS // vocab): 16 Mi
# elements is 32 MiB of bf16 logits and 64 MiB for each float32 [rows, V] temporary.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class PromptLogprobs:
    """Raw logprobs of prompt tokens start, start + 1, ... (token j scored by the logits at position
    j - 1): each token's own logprob and rank (1 = most likely), and the top-k of its position."""
    start: int
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]      # [] per token when prompt_logprobs=0
    top_logprobs: list[list[float]]


@dataclass
class _Chunk:
    """One step's scored prompt tokens of one request, on the device."""
    start: int                        # prompt index of its first scored token
    logprob_R: torch.Tensor           # float32
    rank_R: torch.Tensor              # int64
    top_vals_RK: torch.Tensor | None  # float32, K = the request's prompt_logprobs; None for 0
    top_ids_RK: torch.Tensor | None   # int64


class PromptLogprobsTracker:
    """Which requests of the runner still score prompt tokens, and the scoring of one step."""

    def __init__(self, enabled: bool, vocab_size: int) -> None:
        self.enabled = enabled  # this rank computes logits (the last pipeline stage)
        self.rows_per_call = max(1, CHUNK_ELEMENTS // max(vocab_size, 1))
        self.active: set[str] = set()

    def add(self, req_id: str, state: RequestState) -> None:
        """A request the runner starts tracking: scored when it asks for prompt logprobs and has
        produced nothing yet (else its prompt logprobs went out with its first token)."""
        if (self.enabled and state.params.prompt_logprobs is not None and state.num_prompt_tokens > 1
                and len(state.token_ids) == state.num_prompt_tokens):
            state.prompt_chunks = []
            self.active.add(req_id)

    def drop(self, req_id: str) -> None:
        self.active.discard(req_id)

    def step(self, batch: StepBatch, hidden_TD: torch.Tensor, model, is_driver: bool) -> dict[str, list[_Chunk]]:
        """Score the prompt tokens this step computes the logits of; returns (on the driver rank)
        the chunks of the requests whose prompt ends in this step, by request id."""
        rows: list[np.ndarray] = []
        targets: list[list[int]] = []
        segments: list[tuple[RequestState, int, int]] = []  # (state, first scored token, count)
        finals: list[tuple[str, RequestState]] = []
        for i, (req_id, state) in enumerate(zip(batch.req_ids, batch.states)):
            if state.prompt_chunks is None:
                continue
            c, n, P = state.num_computed_tokens, int(batch.num_tokens_B[i]), state.num_prompt_tokens
            end = min(c + n, P - 1)
            if end > c:
                q = int(batch.query_start_loc[i])
                rows.append(np.arange(q, q + end - c, dtype=np.int64))
                targets.append(state.token_ids[c + 1:end + 1])
                segments.append((state, c + 1, end - c))
            if c + n >= P:
                finals.append((req_id, state))
        if segments:
            self._score(rows, targets, segments, hidden_TD, model, is_driver)
        out = {}
        for req_id, state in finals:
            if is_driver:
                out[req_id] = state.prompt_chunks
            state.prompt_chunks = None
            self.active.discard(req_id)
        return out

    def _score(self, rows: list[np.ndarray], targets: list[list[int]], segments: list, hidden_TD: torch.Tensor,
               model, is_driver: bool) -> None:
        flat = np.concatenate(rows)
        idx = host_to_device(np.stack([flat, np.fromiter((t for ts in targets for t in ts), dtype=np.int64,
                                                          count=len(flat))]), hidden_TD.device)
        k = max(state.params.prompt_logprobs for state, _, _ in segments)
        parts = []
        step = self.rows_per_call
        for s in range(0, len(flat), step):
            logits = model.compute_logits(hidden_TD.index_select(0, idx[0, s:s + step]))  # every TP rank
            if is_driver:
                parts.append(token_logprobs(logits, idx[1, s:s + step], k))
        if not is_driver:
            return
        lp, rank = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        vals = torch.cat([p[2] for p in parts]) if k else None
        ids = torch.cat([p[3] for p in parts]) if k else None
        o = 0
        for state, start, count in segments:
            kk = state.params.prompt_logprobs
            state.prompt_chunks.append(_Chunk(start, lp[o:o + count], rank[o:o + count],
                                              vals[o:o + count, :kk] if kk else None,
                                              ids[o:o + count, :kk] if kk else None))
            o += count


def stage_prompt_logprobs(finals: dict[str, list[_Chunk]]) -> tuple[dict[tuple, torch.Tensor], dict[str, int]]:
    """The device tensors of each finished prompt, whole ((request id, name) -> tensor), and the
    prompt index of each one's first scored token (PendingStep copies the tensors to the host)."""
    tensors, starts = {}, {}
    for req_id, chunks in finals.items():
        for a, b in zip(chunks, chunks[1:]):
            if b.start != a.start + len(a.logprob_R):
                raise RuntimeError(f"request {req_id}: prompt logprobs of tokens {a.start}.. and {b.start}.. "
                                   "are not contiguous")
        starts[req_id] = chunks[0].start if chunks else 1
        if not chunks:
            continue
        tensors[(req_id, "logprob")] = torch.cat([c.logprob_R for c in chunks])
        tensors[(req_id, "rank")] = torch.cat([c.rank_R for c in chunks])
        if chunks[0].top_ids_RK is not None:
            tensors[(req_id, "top_vals")] = torch.cat([c.top_vals_RK for c in chunks])
            tensors[(req_id, "top_ids")] = torch.cat([c.top_ids_RK for c in chunks])
    return tensors, starts


def assemble_prompt_logprobs(lists: dict, starts: dict[str, int]) -> dict[str, PromptLogprobs]:
    """PromptLogprobs of each request of `starts` from the host lists of its staged tensors."""
    out = {}
    for req_id, start in starts.items():
        lp = lists.get((req_id, "logprob"), [])
        out[req_id] = PromptLogprobs(start, lp, lists.get((req_id, "rank"), []),
                                     lists.get((req_id, "top_ids"), [[]] * len(lp)),
                                     lists.get((req_id, "top_vals"), [[]] * len(lp)))
    return out
