"""Token sampling for one step's batch: structured outputs' grammar masks, penalties, logit_bias /
allowed_token_ids / bad words, temperature, top-k, top-p, min-p, per-request seeds, and logprobs
of the raw model distribution (as vLLM reports them: after the grammar mask, before everything
else); `token_logprobs` scores given tokens the same way (prompt logprobs).

Legend: B rows (one per sampling request), R rows scored (prompt positions), K top-k, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.token_bitmask import apply_token_bitmask

_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling settings, built by the model runner each step."""
    temperature_B: torch.Tensor            # float32; 0 = greedy
    top_k_B: torch.Tensor | None           # int64, 0 = off; None when no row uses it
    top_p_B: torch.Tensor | None           # float32, 1 = off
    min_p_B: torch.Tensor | None           # float32, 0 = off
    seeds: list[int | None]                # per-row seed derived from (request seed, step); None = shared RNG
    all_greedy: bool
    max_num_logprobs: int                  # largest logprobs=k in the batch; -1 = none asked
    # Penalties (None when no row uses them): [B, V] counts of output tokens, [B, V] prompt presence.
    output_counts_BV: torch.Tensor | None = None
    prompt_mask_BV: torch.Tensor | None = None
    repetition_penalty_B: torch.Tensor | None = None
    frequency_penalty_B: torch.Tensor | None = None
    presence_penalty_B: torch.Tensor | None = None
    # Rows still under min_tokens and the token ids they must not produce yet: [2, n] int64
    # (row, token id) pairs on the device.
    banned_tokens: torch.Tensor | None = None
    # logit_bias, allowed_token_ids and bad words, in one upload: [3, n] float64 (row; token id;
    # value). The first `num_allowed` columns are the tokens their rows are restricted to (value
    # unused); the others are added to the logits (-inf: banned).
    token_bias: torch.Tensor | None = None
    num_allowed: int = 0
    # Multi-token bad words whose prefix ends in a token still being sampled by the step in flight
    # (async scheduling): [4, n] int64 (row; banned token id; index into pending_tokens; the token
    # the prefix needs there). The ban applies on the device when that token matches.
    pending_bans: torch.Tensor | None = None
    pending_tokens: torch.Tensor | None = None  # the step in flight's sampled tokens
    # Structured outputs: the rows whose tokens a grammar constrains (int64 [R]) and their allowed
    # tokens (int32 [R, ceil(V / 32)], llguidance's packed bits), on the device.
    grammar_rows_R: torch.Tensor | None = None
    grammar_bitmask_RW: torch.Tensor | None = None

    @property
    def adjusts_logits(self) -> bool:
        return self.output_counts_BV is not None or self.banned_tokens is not None or \
            self.token_bias is not None or self.pending_bans is not None


@dataclass
class SamplerOutput:
    sampled_B: torch.Tensor                     # int64
    logprob_ids_BK: torch.Tensor | None = None  # top-k ids of the raw distribution
    logprob_vals_BK: torch.Tensor | None = None
    sampled_logprob_B: torch.Tensor | None = None
    sampled_rank_B: torch.Tensor | None = None


def _apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.repetition_penalty_B is not None:
        seen = (b.output_counts_BV > 0) | b.prompt_mask_BV
        p = b.repetition_penalty_B[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if b.frequency_penalty_B is not None:
        logits = logits - b.frequency_penalty_B[:, None] * b.output_counts_BV
        logits = logits - b.presence_penalty_B[:, None] * (b.output_counts_BV > 0).to(logits.dtype)
    return logits


def _apply_token_bias(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """allowed_token_ids, then the added values: device ops only (the slices use a host count)."""
    rows, ids, values = b.token_bias[0].long(), b.token_bias[1].long(), b.token_bias[2].to(logits.dtype)
    k = b.num_allowed
    if k:
        allowed = torch.zeros_like(logits, dtype=torch.bool).index_put_(
            (rows[:k], ids[:k]), torch.ones((), dtype=torch.bool, device=logits.device))
        restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device).index_fill_(0, rows[:k], True)
        logits = logits.masked_fill(restricted[:, None] & ~allowed, float("-inf"))
    return logits.index_put((rows[k:], ids[k:]), values[k:], accumulate=True)


def _apply_pending_bans(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    rows, ids, src, needed = b.pending_bans
    hit = b.pending_tokens.index_select(0, src) == needed
    return logits.index_put((rows, ids), torch.zeros(hit.shape, device=logits.device).masked_fill(hit, float("-inf")),
                            accumulate=True)


def _filter(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k / top-p / min-p."""
    if b.top_k_B is not None or b.top_p_B is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        V = logits.shape[-1]
        if b.top_k_B is not None:
            k = torch.where(b.top_k_B > 0, b.top_k_B, V).clamp(max=V)
            remove |= torch.arange(V, device=logits.device)[None, :] >= k[:, None]
        if b.top_p_B is not None:
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
            before = probs.cumsum(-1) - probs  # mass of the more likely tokens
            # Keep the smallest head whose mass reaches top_p; top_p = 1 never removes anything
            # (rounding could otherwise push `before` to 1.0 in the tail).
            remove |= (before >= b.top_p_B[:, None]) & (b.top_p_B[:, None] < 1)
        remove[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    if b.min_p_B is not None:
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * b.min_p_B[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _noise(probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_()
    for row, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            q[row].exponential_(generator=gen)
    return q


def sample(logits_BV: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    if b.grammar_bitmask_RW is not None:
        # In place, before anything reads the logits: as in vLLM, the logprobs reported are then
        # those of the masked distribution, and the greedy fast path below stays valid.
        apply_token_bitmask(logits_BV, b.grammar_rows_R, b.grammar_bitmask_RW)
    if b.all_greedy and b.max_num_logprobs < 0 and not b.adjusts_logits:
        # The argmax of the logits as they come (bf16 on a GPU): the float32 copy would be exact,
        # so its argmax (the first maximum) is the same, but at 256 rows of a 152k vocabulary the
        # copy alone cost 94 us of a decode step on an H200 (BENCHMARKS.md §4).
        return SamplerOutput(logits_BV.argmax(-1))
    logits = logits_BV.float()
    raw_logprobs = logits.log_softmax(-1) if b.max_num_logprobs >= 0 else None
    if b.output_counts_BV is not None:
        logits = _apply_penalties(logits, b)
    if b.banned_tokens is not None:
        logits = logits.index_put((b.banned_tokens[0], b.banned_tokens[1]),
                                  torch.full((), float("-inf"), device=logits.device))
    if b.token_bias is not None:
        logits = _apply_token_bias(logits, b)
    if b.pending_bans is not None:
        logits = _apply_pending_bans(logits, b)
    greedy = logits.argmax(-1)
    if b.all_greedy:
        sampled = greedy
    else:
        temp = torch.where(b.temperature_B < _EPS, torch.ones_like(b.temperature_B), b.temperature_B)
        probs = _filter(logits / temp[:, None], b).softmax(-1)
        # Exponential race: argmax(p / Exp(1)) draws from p, and a seeded row's draw depends
        # only on its own seed, not on the batch around it.
        random = (probs / _noise(probs, b.seeds)).argmax(-1)
        sampled = torch.where(b.temperature_B < _EPS, greedy, random)
    out = SamplerOutput(sampled)
    if raw_logprobs is not None:
        k = b.max_num_logprobs
        if k > 0:
            out.logprob_vals_BK, out.logprob_ids_BK = raw_logprobs.topk(k, dim=-1)
        chosen = raw_logprobs.gather(-1, sampled[:, None])
        out.sampled_logprob_B = chosen[:, 0]
        out.sampled_rank_B = (raw_logprobs > chosen).sum(-1) + 1
    return out


def token_logprobs(logits_RV: torch.Tensor, token_ids_R: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The raw distribution's logprob and rank (1 = most likely; ties rank alike) of given tokens,
    and its top-k: (logprob_R float32, rank_R int64, top_vals_RK float32, top_ids_RK int64), the top
    ones None for k = 0. logits_RV: any float dtype; token_ids_R: int64 on the same device. The
    float32 copy and its log_softmax are [R, V] each: the caller bounds R."""
    logprobs = logits_RV.float().log_softmax(-1)
    chosen = logprobs.gather(-1, token_ids_R[:, None])
    rank = (logprobs > chosen).sum(-1) + 1
    vals, ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    return chosen[:, 0], rank, vals, ids
