"""The model runner: keeps per-request token/block state, turns each SchedulerOutput into
batch tensors, runs the model, samples, and returns the new tokens.

It sees only SchedulerOutputs, so a multi-process executor can broadcast the same object to
every rank's runner.

Parallel ranks: every rank of a DP replica runs the same batch. With pipeline parallelism a
stage receives the previous stage's activations and sends its own on (moe/pipeline.py); logits
come from the last stage (all its TP ranks take part in the vocab gather), and only the
replica's driver rank (last stage, TP rank 0) samples: sampling is done once and its tokens are
sent to the other ranks of the replica with the next step (`apply_sampled`), so every rank
appends exactly the tokens the driver drew, whatever the sampling parameters.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from moe.distributed import get_parallel_state, pp_recv, pp_send
from moe.sampler import SamplingBatch, sample
from moe.sampling_params import SamplingParams
from scheduler import KVCacheGroup, SchedulerOutput

logger = logging.getLogger("moe.runner")


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[list[int]]  # one list per KV-cache group
    num_computed_tokens: int


@dataclass
class TokenLogprobs:
    """Raw logprobs of one sampled token: the token's own, its rank, and the top-k."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def _derived_seed(seed: int, output_index: int) -> int:
    # A seeded request's draw for its i-th token depends only on (seed, i): reproducible
    # across batch compositions and after preemption.
    return hash((seed, output_index)) & ((1 << 63) - 1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        ps = get_parallel_state()
        self.is_driver = ps.is_driver
        self.pp_size, self.is_first_stage, self.is_last_stage = ps.pp_size, ps.is_first_pp_rank, ps.is_last_pp_rank
        # A replica without work still runs a one-token forward (MoE collectives span DP
        # replicas); its KV write goes to one extra block that the scheduler never hands out.
        self.reserve_dummy_block = ps.needs_dummy_batches
        self.dummy_blocks: list[int] | None = None  # per KV-cache group

    # ---- KV cache ----------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        total = 0
        for attn in self.model.attention_layers():
            shape = attn.kv_cache_shape(1, self.block_size)
            total += int(np.prod(shape)) * torch.finfo(self.kv_dtype).bits // 8
        return total

    @property
    def kv_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def allocate_kv_cache(self, groups: int | list[KVCacheGroup]) -> None:
        """One zeroed cache tensor per attention layer, sized by its KV-cache group's block
        count (an int = one full-attention group of that many blocks)."""
        if isinstance(groups, int):
            groups = [KVCacheGroup(None, groups)]
        keys = [g.chunk_size for g in groups]
        self.kv_caches = []
        self.num_kv_groups = len(groups)
        # The dummy batch writes to one extra block per group, never handed out by the scheduler.
        self.dummy_blocks = [g.num_blocks for g in groups] if self.reserve_dummy_block and groups[0].num_blocks \
            else None
        extra = 1 if self.dummy_blocks else 0
        for attn in self.model.attention_layers():
            group = keys.index(getattr(attn, "chunk_size", None))
            attn.kv_group = group
            cache = torch.zeros(attn.kv_cache_shape(groups[group].num_blocks + extra, self.block_size),
                                dtype=self.kv_dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    def kv_cache_chunk_sizes(self) -> list[int | None]:
        """Per attention layer of this rank: its chunked-local window, or None."""
        return [getattr(attn, "chunk_size", None) for attn in self.model.attention_layers()]

    # ---- one step ----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RequestState(list(new.token_ids), new.num_prompt_tokens,
                                                     new.sampling_params, [list(g) for g in new.block_ids],
                                                     new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            for group, ids in enumerate(new_blocks):  # () when no group added a block
                state.block_ids[group].extend(ids)
            state.num_computed_tokens = num_computed

    def _prepare(self, so: SchedulerOutput):
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        n = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        seq_lens = computed + n
        input_ids: list[int] = []
        for s, k in zip(states, n.tolist()):  # Python ints: numpy scalars index slowly
            c = s.num_computed_tokens
            input_ids.extend(s.token_ids[c:c + k])
        row = np.repeat(np.arange(len(states)), n)
        positions = np.arange(qsl[-1]) - qsl[:-1][row] + computed[row]
        decode = np.nonzero(n == 1)[0]
        layout = dict(query_start_loc=qsl.tolist(), seq_lens=seq_lens.tolist(), decode_seqs=decode.tolist(),
                      prefill_seqs=np.nonzero(n != 1)[0].tolist())
        metas = [self._group_metadata([s.block_ids[g] for s in states], row, positions, qsl, seq_lens, decode, layout)
                 for g in range(len(states[0].block_ids))]
        meta = metas[0]
        if len(metas) > 1:
            meta.group_metas = metas
        # Rows that reach the end of their known tokens produce a next token.
        known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=len(states))
        sample_rows = np.nonzero(seq_lens == known)[0].tolist()
        return (req_ids, states, torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.from_numpy(positions).to(self.device), meta, qsl, sample_rows)

    def _group_metadata(self, block_ids: list[list[int]], row, positions, qsl, seq_lens, decode,
                        layout: dict) -> AttentionMetadata:
        """Block tables and slot mapping of one KV-cache group; the batch layout is shared."""
        dev, bs = self.device, self.block_size
        lens = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
        tables = np.zeros((len(block_ids), int(lens.max())), dtype=np.int64)
        # one vectorised fill: row i's first lens[i] entries, in row order
        tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_ids), dtype=np.int64, count=int(lens.sum()))
        slots = tables[row, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(block_tables_BM=torch.from_numpy(tables).to(dev),
                                 slot_mapping_T=torch.from_numpy(slots).to(dev), **layout)
        if len(decode):
            nblk = -(-int(seq_lens[decode].max()) // bs)
            meta.decode_token_idx = torch.from_numpy(qsl[decode]).to(dev)
            meta.decode_seq_lens = torch.from_numpy(seq_lens[decode]).to(dev)
            meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(tables[decode, :nblk])).to(dev)
        return meta

    def _sampling_batch(self, states: list[RequestState]) -> SamplingBatch:
        dev = self.device
        params = [s.params for s in states]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        batch = SamplingBatch(
            temperature_B=temperature,
            top_k_B=torch.tensor(top_k, device=dev) if any(top_k) else None,
            top_p_B=torch.tensor(top_p, dtype=torch.float32, device=dev) if any(x < 1 for x in top_p) else None,
            min_p_B=torch.tensor(min_p, dtype=torch.float32, device=dev) if any(min_p) else None,
            seeds=[None if p.seed is None else _derived_seed(p.seed, len(s.token_ids) - s.num_prompt_tokens)
                   for p, s in zip(params, states)],
            all_greedy=all(p.is_greedy for p in params),
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
            V, B = self.vocab_size, len(states)
            counts = torch.zeros(B, V, dtype=torch.float32, device=dev)
            prompt = torch.zeros(B, V, dtype=torch.bool, device=dev)
            for i, s in enumerate(states):
                out = torch.tensor(s.token_ids[s.num_prompt_tokens:], dtype=torch.long, device=dev)
                counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
                prompt[i, torch.tensor(s.token_ids[:s.num_prompt_tokens], dtype=torch.long, device=dev)] = True
            batch.output_counts_BV, batch.prompt_mask_BV = counts, prompt
            batch.repetition_penalty_B = torch.tensor([p.repetition_penalty for p in params], device=dev)
            batch.frequency_penalty_B = torch.tensor([p.frequency_penalty for p in params], device=dev)
            batch.presence_penalty_B = torch.tensor([p.presence_penalty for p in params], device=dev)
        banned = []
        for i, (p, s) in enumerate(zip(params, states)):
            if len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
                stops = ([] if p.ignore_eos else self.eos_token_ids) + list(p.stop_token_ids)
                if stops:
                    banned.append((i, stops))
        batch.banned_tokens = banned or None
        return batch

    def apply_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Append the tokens the replica's driver rank sampled last step (non-driver ranks)."""
        for req_id, tokens in sampled.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.token_ids.extend(tokens)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """The model on this rank's stage: final hidden states [T, D] on the last stage, None on
        the others (their activations went to the next stage)."""
        if self.pp_size == 1:
            return self.model(input_ids, positions, meta)
        intermediate = None
        if not self.is_first_stage:
            intermediate = self.model.make_empty_intermediate_tensors(input_ids.shape[0], self.kv_dtype, self.device)
            pp_recv(intermediate)
        out = self.model(input_ids, positions, meta, intermediate_tensors=intermediate)
        if self.is_last_stage:
            return out
        pp_send(out)
        return None

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """One token at position 0 written to the reserved block: runs every collective of a
        forward (MoE dispatch/combine, TP, PP) without touching any request's state."""
        if self.dummy_blocks is None:
            raise RuntimeError("a dummy batch needs the reserved KV blocks (allocate_kv_cache first)")
        dev = self.device
        metas = []
        for block in self.dummy_blocks:
            table = torch.tensor([[block]], dtype=torch.int64, device=dev)
            metas.append(AttentionMetadata(
                query_start_loc=[0, 1], seq_lens=[1], block_tables_BM=table,
                slot_mapping_T=torch.tensor([block * self.block_size], dtype=torch.int64, device=dev),
                decode_seqs=[0], prefill_seqs=[], decode_token_idx=torch.zeros(1, dtype=torch.int64, device=dev),
                decode_seq_lens=torch.ones(1, dtype=torch.int64, device=dev), decode_block_tables=table))
        meta = metas[0]
        if len(metas) > 1:
            meta.group_metas = metas
        self._forward(torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev), meta)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, dummy: bool = False) -> ModelRunnerOutput:
        """Run one step. `dummy`: when `so` is empty, run a one-token forward anyway (another DP
        replica has work and the MoE collectives need every rank)."""
        self._update_states(so)
        if so.is_empty:
            if dummy:
                self.execute_dummy()
            return ModelRunnerOutput()
        req_ids, states, input_ids, positions, meta, qsl, sample_rows = self._prepare(so)
        hidden = self._forward(input_ids, positions, meta)
        out = ModelRunnerOutput()
        if not sample_rows or hidden is None:
            return out
        idx = torch.from_numpy(qsl[np.asarray(sample_rows) + 1] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[idx])  # a TP collective: every TP rank of the stage
        if not self.is_driver:
            return out
        sample_states = [states[i] for i in sample_rows]
        result = sample(logits, self._sampling_batch(sample_states))
        sampled = result.sampled_B.tolist()
        want_logprobs = result.sampled_logprob_B is not None
        if want_logprobs:
            lp = result.sampled_logprob_B.tolist()
            ranks = result.sampled_rank_B.tolist()
            top_ids = result.logprob_ids_BK.tolist() if result.logprob_ids_BK is not None else None
            top_vals = result.logprob_vals_BK.tolist() if result.logprob_vals_BK is not None else None
        for j, i in enumerate(sample_rows):
            req_id, state = req_ids[i], states[i]
            state.token_ids.append(sampled[j])
            out.sampled[req_id] = [sampled[j]]
            k = state.params.logprobs
            if want_logprobs and k is not None:
                out.logprobs[req_id] = [TokenLogprobs(sampled[j], lp[j], ranks[j],
                                                      top_ids[j][:k] if top_ids else [],
                                                      top_vals[j][:k] if top_vals else [])]
        return out
