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

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from models.layers.attention import use_triton_attention
from moe.block_tables import BlockTables
from moe.cuda_graphs import DecodeGraphs, default_capture_sizes
from moe.distributed import get_parallel_state, pp_recv, pp_send
from moe.sampler import SamplingBatch, sample
from moe.sampling_params import SamplingParams
from moe.step_buffers import StepBuffers
from scheduler import KVCacheGroup, SchedulerOutput

logger = logging.getLogger("moe.runner")


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    row: int  # its row of the runner's BlockTables
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


@dataclass
class StepBatch:
    """One step's batch on the host: the layout every path derives its tensors from."""
    req_ids: list[str]
    states: list[RequestState]
    num_tokens_B: np.ndarray       # new tokens per sequence
    query_start_loc: np.ndarray    # [B+1]
    seq_lens_B: np.ndarray         # context after this step
    input_ids_T: np.ndarray
    positions_T: np.ndarray
    row_T: np.ndarray              # sequence of each token
    tables: list[np.ndarray]       # per KV-cache group [B, m]
    sample_rows: list[int]         # sequences that produce a token this step

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids_T) == len(self.req_ids)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int, enforce_eager: bool = True,
                 cudagraph_capture_sizes: list[int] | None = None) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[str, RequestState] = {}
        self.block_tables: BlockTables | None = None  # made with the KV cache (its group count)
        self.kv_caches: list[torch.Tensor] = []
        ps = get_parallel_state()
        self.is_driver = ps.is_driver
        self.pp_size, self.is_first_stage, self.is_last_stage = ps.pp_size, ps.is_first_pp_rank, ps.is_last_pp_rank
        # A replica without work still runs a one-token forward (MoE collectives span DP
        # replicas); its KV write goes to one extra block that the scheduler never hands out.
        self.reserve_dummy_block = ps.needs_dummy_batches
        self.dummy_blocks: list[int] | None = None  # per KV-cache group
        # The GPU path: step inputs through reused pinned/device buffers, Triton attention, and
        # CUDA graphs for decode-only steps (not across pipeline stages, nor with a token
        # dispatcher, whose count exchange syncs with the host).
        self.gpu_inputs = use_triton_attention(torch.empty(0, device=device))
        graphs_ok = self.gpu_inputs and ps.pp_size == 1 and not (ps.enable_expert_parallel and ps.ep_size > 1)
        if self.gpu_inputs and not enforce_eager and not graphs_ok:
            logger.info("CUDA graphs are off for pipeline or expert parallelism: steps run eagerly")
        self.use_cuda_graphs = graphs_ok and not enforce_eager and device.type == "cuda"
        self.cudagraph_capture_sizes = cudagraph_capture_sizes
        self.limits: tuple[int, int, int] | None = None  # max_num_seqs, max_model_len, max_num_batched_tokens
        self.buffers: StepBuffers | None = None
        self.graphs: DecodeGraphs | None = None

    def configure(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> None:
        """The engine's limits, which size the step buffers and the CUDA graphs."""
        self.limits = (max_num_seqs, max_model_len, max_num_batched_tokens)

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
        self.requests.clear()  # their blocks belonged to the previous cache
        self.block_tables = BlockTables(len(groups))
        self.graphs = None  # captured over the previous cache tensors
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
        if self.gpu_inputs and self.limits is not None:
            max_num_seqs, max_model_len, max_tokens = self.limits
            sizes = self._capture_sizes()
            # The profiling forward packs the token budget into sequences of max_model_len.
            max_seqs = max(max_num_seqs, max(sizes, default=1), -(-max_tokens // max_model_len))
            self.buffers = StepBuffers(self.device, max(max_tokens, max_seqs), max_seqs,
                                       -(-max_model_len // self.block_size) + 1, len(groups))

    def _capture_sizes(self) -> list[int]:
        if not self.use_cuda_graphs or self.limits is None:
            return []
        return self.cudagraph_capture_sizes or default_capture_sizes(self.limits[0])

    def capture_cuda_graphs(self) -> None:
        """Capture the decode forwards (after the KV cache is allocated; every rank of a
        tensor-parallel group captures the same sizes in the same order)."""
        sizes = self._capture_sizes()
        if not sizes or self.buffers is None or not self.kv_caches:
            return
        self.graphs = DecodeGraphs(sizes)
        self.graphs.capture(self._upload_padding, self._graph_forward, self.device)

    def _upload_padding(self, b: int) -> None:
        """b padding decode rows into the step buffers (what a graph is captured over)."""
        buf = self.buffers
        buf.begin()
        buf.host_view("input_ids", b)[:] = 0
        buf.host_view("positions", b)[:] = 0
        buf.host_view("query_start_loc", b + 1)[:] = np.arange(b + 1)
        buf.host_view("seq_lens", b)[:] = 0
        sizes = {"input_ids": b, "positions": b, "query_start_loc": b + 1, "seq_lens": b}
        for g in range(self.num_kv_groups):
            buf.host_view(f"slots{g}", b)[:] = -1
            sizes[f"slots{g}"] = b
        buf.upload(sizes)

    @torch.inference_mode()
    def _graph_forward(self, b: int) -> torch.Tensor:
        """The model on b decode rows read from the step buffers (what a graph captures)."""
        buf = self.buffers
        meta = self._device_metadata(b, b, 1, list(range(b + 1)), [1] * b, decode_only=True)
        return self._forward(buf.dev_view("input_ids", b), buf.dev_view("positions", b), meta)

    def release(self) -> None:
        """Drop the KV cache, the CUDA graphs (their memory pool) and the step buffers."""
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        self.kv_caches, self.graphs, self.buffers = [], None, None
        self.requests.clear()

    def kv_cache_chunk_sizes(self) -> list[int | None]:
        """Per attention layer of this rank: its chunked-local window, or None."""
        return [getattr(attn, "chunk_size", None) for attn in self.model.attention_layers()]

    # ---- one step ----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        tables = self.block_tables
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                tables.remove(state.row)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = RequestState(list(new.token_ids), new.num_prompt_tokens,
                                                     new.sampling_params, tables.add(new.block_ids),
                                                     new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            for group, ids in enumerate(new_blocks):  # () when no group added a block
                tables.extend(state.row, group, ids)
            state.num_computed_tokens = num_computed

    def _batch(self, so: SchedulerOutput) -> StepBatch:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        computed = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(states))
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        seq_lens = computed + n
        T = int(qsl[-1])
        if T == len(states):  # decode-only: each sequence's newest token
            input_ids = np.fromiter((s.token_ids[s.num_computed_tokens] for s in states), dtype=np.int64, count=T)
            row, positions = np.arange(T), computed
        else:
            ids: list[int] = []
            for s, k in zip(states, n.tolist()):  # Python ints: numpy scalars index slowly
                c = s.num_computed_tokens
                ids.extend(s.token_ids[c:c + k])
            input_ids = np.asarray(ids, dtype=np.int64)
            row = np.repeat(np.arange(len(states)), n)
            positions = np.arange(T) - qsl[:-1][row] + computed[row]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        tables = [self.block_tables.gather(g, rows) for g in range(self.block_tables.num_groups)]
        # Rows that reach the end of their known tokens produce a next token.
        known = np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=len(states))
        sample_rows = np.nonzero(seq_lens == known)[0].tolist()
        return StepBatch(req_ids, states, n, qsl, seq_lens, input_ids, positions, row, tables, sample_rows)

    def _slots(self, table: np.ndarray, batch: StepBatch) -> np.ndarray:
        bs = self.block_size
        return table[batch.row_T, batch.positions_T // bs] * bs + batch.positions_T % bs

    def _host_metadata(self, batch: StepBatch) -> AttentionMetadata:
        """Metadata for the torch reference path: fresh device tensors (CPU runs)."""
        dev, qsl, seq_lens = self.device, batch.query_start_loc, batch.seq_lens_B
        decode = np.nonzero(batch.num_tokens_B == 1)[0]
        layout = dict(query_start_loc=qsl.tolist(), seq_lens=seq_lens.tolist(), decode_seqs=decode.tolist(),
                      prefill_seqs=np.nonzero(batch.num_tokens_B != 1)[0].tolist())
        metas = []
        for table in batch.tables:
            meta = AttentionMetadata(block_tables_BM=torch.from_numpy(table).to(dev),
                                     slot_mapping_T=torch.from_numpy(self._slots(table, batch)).to(dev), **layout)
            if len(decode):
                nblk = -(-int(seq_lens[decode].max()) // self.block_size)
                meta.decode_token_idx = torch.from_numpy(qsl[decode]).to(dev)
                meta.decode_seq_lens = torch.from_numpy(seq_lens[decode]).to(dev)
                meta.decode_block_tables = torch.from_numpy(np.ascontiguousarray(table[decode, :nblk])).to(dev)
            metas.append(meta)
        if self.gpu_inputs:  # a GPU step that does not fit the buffers: device fields too
            for meta in metas:
                meta.query_start_loc_t = torch.from_numpy(qsl).to(dev, torch.int32)
                meta.seq_lens_t = torch.from_numpy(seq_lens).to(dev, torch.int32)
                meta.max_query_len, meta.decode_only = int(batch.num_tokens_B.max()), batch.decode_only
        return _grouped(metas)

    def _upload(self, batch: StepBatch, padded: int | None = None) -> AttentionMetadata:
        """Write the batch into the step buffers (decode rows padded to `padded`), upload it,
        and return metadata over the device views."""
        buf = self.buffers
        T, B = len(batch.input_ids_T), len(batch.req_ids)
        t, b = (padded, padded) if padded else (T, B)
        buf.begin()
        sizes = {"input_ids": t, "positions": t, "query_start_loc": b + 1, "seq_lens": b}
        _fill(buf.host_view("input_ids", t), batch.input_ids_T, 0)
        _fill(buf.host_view("positions", t), batch.positions_T, 0)
        qsl = buf.host_view("query_start_loc", b + 1)
        qsl[:B + 1] = batch.query_start_loc
        qsl[B + 1:] = T + np.arange(1, b - B + 1)  # padding rows: one query each
        _fill(buf.host_view("seq_lens", b), batch.seq_lens_B, 0)
        for g, table in enumerate(batch.tables):
            _fill(buf.host_view(f"slots{g}", t), self._slots(table, batch), -1)
            sizes[f"slots{g}"] = t
            buf.upload_tables(g, table)
        buf.upload(sizes)
        meta = self._device_metadata(t, b, int(batch.num_tokens_B.max()), batch.query_start_loc.tolist(),
                                     batch.seq_lens_B.tolist(), batch.decode_only)
        if not batch.decode_only and meta.decode_seqs:  # a mixed batch: its decode rows for MLA's absorbed path
            decode = np.asarray(meta.decode_seqs)
            dev = self.device
            for g, m in enumerate(meta.group_metas or [meta]):
                nblk = -(-int(batch.seq_lens_B[decode].max()) // self.block_size)
                m.decode_token_idx = torch.from_numpy(batch.query_start_loc[decode]).to(dev)
                m.decode_seq_lens = torch.from_numpy(batch.seq_lens_B[decode]).to(dev)
                m.decode_block_tables = torch.from_numpy(np.ascontiguousarray(batch.tables[g][decode, :nblk])).to(dev)
        return meta

    def _device_metadata(self, t: int, b: int, max_query_len: int, qsl: list[int], seq_lens: list[int],
                         decode_only: bool) -> AttentionMetadata:
        buf = self.buffers
        qsl_t, seq_lens_t = buf.dev_view("query_start_loc", b + 1), buf.dev_view("seq_lens", b)
        if decode_only:
            decode, prefill = list(range(len(seq_lens))), []
        else:
            decode = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
            prefill = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] != 1]
        metas = [AttentionMetadata(qsl, seq_lens, buf.tables[g][:b], buf.dev_view(f"slots{g}", t), decode, prefill,
                                   query_start_loc_t=qsl_t, seq_lens_t=seq_lens_t, max_query_len=max_query_len,
                                   decode_only=decode_only)
                 for g in range(self.num_kv_groups)]
        return _grouped(metas)

    def _sampling_batch(self, states: list[RequestState]) -> SamplingBatch:
        dev = self.device
        params = [s.params for s in states]
        all_greedy = all(p.is_greedy for p in params)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        batch = SamplingBatch(
            temperature_B=None if all_greedy else torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                                               device=dev),
            top_k_B=torch.tensor(top_k, device=dev) if not all_greedy and any(top_k) else None,
            top_p_B=torch.tensor(top_p, dtype=torch.float32, device=dev)
            if not all_greedy and any(x < 1 for x in top_p) else None,
            min_p_B=torch.tensor(min_p, dtype=torch.float32, device=dev) if not all_greedy and any(min_p) else None,
            seeds=None if all_greedy else
            [None if p.seed is None else _derived_seed(p.seed, len(s.token_ids) - s.num_prompt_tokens)
             for p, s in zip(params, states)],
            all_greedy=all_greedy,
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
            if p.min_tokens and len(s.token_ids) - s.num_prompt_tokens < p.min_tokens:
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

    def _run_batch(self, batch: StepBatch):
        """Hidden states of the batch's tokens (None off the last pipeline stage): a CUDA-graph
        replay for a decode-only step within the captured sizes, else an eager forward."""
        T, B = len(batch.input_ids_T), len(batch.req_ids)
        if self.buffers is None or not self.buffers.fits(T, B, max(t.shape[1] for t in batch.tables)):
            meta = self._host_metadata(batch)
            return self._forward(torch.from_numpy(batch.input_ids_T).to(self.device),
                                 torch.from_numpy(batch.positions_T).to(self.device), meta)
        padded = self.graphs.padded_size(B) if self.graphs is not None and batch.decode_only else None
        meta = self._upload(batch, padded)
        if padded is not None:
            return self.graphs.replay(padded)[:B]
        return self._forward(self.buffers.dev_view("input_ids", T), self.buffers.dev_view("positions", T), meta)

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """One token at position 0 written to the reserved block: runs every collective of a
        forward (MoE dispatch/combine, TP, PP) without touching any request's state."""
        if self.dummy_blocks is None:
            raise RuntimeError("a dummy batch needs the reserved KV blocks (allocate_kv_cache first)")
        one = np.ones(1, dtype=np.int64)
        zero = np.zeros(1, dtype=np.int64)
        batch = StepBatch(["dummy"], [], one, np.array([0, 1]), one, zero, zero, zero,
                          [np.array([[b]], dtype=np.int64) for b in self.dummy_blocks], [])
        self._run_batch(batch)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, dummy: bool = False) -> ModelRunnerOutput:
        """Run one step. `dummy`: when `so` is empty, run a one-token forward anyway (another DP
        replica has work and the MoE collectives need every rank)."""
        self._update_states(so)
        if so.is_empty:
            if dummy:
                self.execute_dummy()
            return ModelRunnerOutput()
        batch = self._batch(so)
        hidden = self._run_batch(batch)
        out = ModelRunnerOutput()
        sample_rows = batch.sample_rows
        if not sample_rows or hidden is None:
            return out
        if len(sample_rows) == hidden.shape[0]:  # every token samples (decode-only)
            last = hidden
        else:
            last = hidden[torch.from_numpy(batch.query_start_loc[np.asarray(sample_rows) + 1] - 1).to(self.device)]
        logits = self.model.compute_logits(last)  # a TP collective: every TP rank of the stage
        if not self.is_driver:
            return out
        states = batch.states
        sample_states = [states[i] for i in sample_rows]
        result = sample(logits, self._sampling_batch(sample_states))
        sampled = result.sampled_B.tolist()
        want_logprobs = result.sampled_logprob_B is not None
        if want_logprobs:
            lp = result.sampled_logprob_B.tolist()
            ranks = result.sampled_rank_B.tolist()
            top_ids = result.logprob_ids_BK.tolist() if result.logprob_ids_BK is not None else None
            top_vals = result.logprob_vals_BK.tolist() if result.logprob_vals_BK is not None else None
        req_ids = batch.req_ids
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


def _fill(dst: np.ndarray, values: np.ndarray, pad: int) -> None:
    """dst = values followed by `pad` up to dst's length."""
    n = len(values)
    dst[:n] = values
    dst[n:] = pad


def _grouped(metas: list[AttentionMetadata]) -> AttentionMetadata:
    """Group 0's metadata, carrying every group's when there are several."""
    meta = metas[0]
    if len(metas) > 1:
        meta.group_metas = metas
    return meta
