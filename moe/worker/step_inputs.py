"""One step's inputs on their way to the model: the batch layout on the host (`StepBatch`, built
from the runner's request states) and the attention metadata made from it, either as fresh tensors
(`host_metadata`: the torch reference path of CPU runs, or a GPU step larger than the buffers) or as
views of the runner's reused `StepBuffers` (`upload`: the GPU path, padded to a CUDA graph's size).

Legend: T tokens of the step, B sequences, m the longest block table of the step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.attention import AttentionMetadata
from kernels.host_to_device import host_to_device
from moe.sampling_params import SamplingParams
from moe.worker.block_tables import BlockTables
from moe.worker.step_buffers import StepBuffers
from scheduler import SchedulerOutput


@dataclass
class RequestState:
    """What the runner keeps of one request between steps."""
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    row: int  # its row of the runner's BlockTables
    num_computed_tokens: int
    mm_items: list | tuple = ()  # the prompt's images (moe/multimodal/inputs.py's ImageItem)
    # Encoder features [num_embeds, D] of the images whose tokens are being computed, by item index.
    encoder_outputs: dict = field(default_factory=dict)
    # SamplingParams.prompt_logprobs being computed: the device results of the prompt's chunks so
    # far (moe/worker/prompt_logprobs.py); None when not asked for, or once handed over.
    prompt_chunks: list | None = None
    # Greedy with nothing of its own to upload (no logprobs, penalties, min_tokens, biases, bad
    # words): a step whose rows are all such samples without looking at each row's parameters.
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_greedy = p.is_greedy and p.logprobs is None and p.repetition_penalty == 1 \
            and not (p.frequency_penalty or p.presence_penalty or p.min_tokens or p.logit_bias
                     or p.allowed_token_ids or p._bad_words_token_ids)


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
    # Per KV-cache group [B, m]: given (a synthetic batch), or None: read from `source` by rows_B
    # when asked (block_table), since the GPU path gathers them on the device instead.
    tables: list[np.ndarray] | None
    sample_rows: list[int]         # sequences that produce a token this step
    # Async scheduling: per token, the runner row whose last sampled token is its input id, when
    # the host does not know it yet (the step in flight samples it; its input_ids_T entry is 0 until
    # filled on the device), else -1. None: the host knows every input id.
    pending_src_T: np.ndarray | None = None
    rows_B: np.ndarray | None = None  # each sequence's row of the runner (BlockTables, last-sampled tokens)
    # The recurrent group's index: its tables hold one state slot per sequence, no per-token slots.
    state_group: int | None = None
    source: BlockTables | None = None  # the runner's tables, rows_B its rows (a built batch)
    _gathered: dict = field(default_factory=dict, repr=False)

    @property
    def decode_only(self) -> bool:
        return len(self.input_ids_T) == len(self.req_ids)

    @property
    def num_groups(self) -> int:
        return self.source.num_groups if self.tables is None else len(self.tables)

    def block_table(self, group: int) -> np.ndarray:
        """[B, m] block table of one group, m = the sequences' longest (padding is stale, never read)."""
        if self.tables is not None:
            return self.tables[group]
        if group not in self._gathered:
            self._gathered[group] = self.source.gather(group, self.rows_B)
        return self._gathered[group]

    def max_blocks(self) -> int:
        """The longest block table of the step, over every group."""
        if self.tables is not None:
            return max(t.shape[1] for t in self.tables)
        if not len(self.rows_B):
            return 0
        return max(int(lens[self.rows_B].max()) for lens in self.source.lens)

    @classmethod
    def build(cls, so: SchedulerOutput, requests: dict[str, RequestState], tables: BlockTables,
              state_group: int | None = None) -> "StepBatch":
        req_ids = list(so.num_scheduled_tokens)
        states = [requests[r] for r in req_ids]
        n = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        computed = np.array([s.num_computed_tokens for s in states], dtype=np.int64)
        qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        seq_lens = computed + n
        T = int(qsl[-1])
        known = np.array([len(s.token_ids) for s in states], dtype=np.int64)
        rows = np.array([s.row for s in states], dtype=np.int64)
        pending_src = None
        if T == len(states):  # decode-only: each sequence's newest token
            waiting = computed >= known  # async: the step in flight samples it
            if not waiting.any():
                input_ids = np.array([s.token_ids[s.num_computed_tokens] for s in states], dtype=np.int64)
            else:
                pending_src = np.where(waiting, rows, -1)
                input_ids = np.zeros(T, dtype=np.int64) if waiting.all() else np.asarray(
                    [s.token_ids[c] if c < len(s.token_ids) else 0 for s, c in zip(states, computed.tolist())],
                    dtype=np.int64)
            row, positions = np.arange(T), computed
        else:
            ids: list[int] = []
            waiting_at: list[tuple[int, int]] = []  # (token index, runner row)
            for s, k in zip(states, n.tolist()):  # Python ints: numpy scalars index slowly
                c = s.num_computed_tokens
                have = s.token_ids[c:c + k]
                if len(have) < k:  # async: the last token comes from the step in flight
                    waiting_at.append((len(ids) + k - 1, s.row))
                    have = have + [0]
                ids.extend(have)
            input_ids = np.asarray(ids, dtype=np.int64)
            if waiting_at:
                pending_src = np.full(T, -1, dtype=np.int64)
                at, src = np.asarray(waiting_at, dtype=np.int64).T
                pending_src[at] = src
            row = np.repeat(np.arange(len(states)), n)
            positions = np.arange(T) - qsl[:-1][row] + computed[row]
        # Rows that reach the end of their known tokens (async: past it) produce a next token.
        sample_rows = np.nonzero(seq_lens >= known)[0].tolist()
        return cls(req_ids, states, n, qsl, seq_lens, input_ids, positions, row, None, sample_rows,
                   pending_src, rows, state_group, tables)

    @classmethod
    def one_token(cls, blocks: list[int]) -> "StepBatch":
        """A one-token sequence at position 0 writing to the given block of each group."""
        one, zero = np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        return cls(["dummy"], [], one, np.array([0, 1]), one, zero, zero, zero,
                   [np.array([[b]], dtype=np.int64) for b in blocks], [])

    @classmethod
    def warm_up(cls, num_tokens: int, num_decode_rows: int, max_chunk: int, block_size: int,
                num_groups: int) -> "StepBatch":
        """A mixed step of num_tokens tokens for compiling kernels: num_decode_rows one-token
        sequences beside chunks of at most max_chunk tokens holding the rest (positions from 0),
        every sequence reading and writing blocks 0, 1, ... of each group (no request owns them
        yet). The decode rows sit past the first chunk's last position, so they read a context of
        its length + 1."""
        rest = num_tokens - num_decode_rows
        if rest < 1 or num_decode_rows < 0 or max_chunk < 1:
            raise ValueError(f"a warm-up step needs a chunk: {num_tokens} tokens, {num_decode_rows} decode rows")
        chunks = [max_chunk] * (rest // max_chunk) + ([rest % max_chunk] if rest % max_chunk else [])
        n = np.array([1] * num_decode_rows + chunks, dtype=np.int64)
        B = len(n)
        qsl = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(n, out=qsl[1:])
        first = chunks[0]
        seq_lens = np.concatenate([np.full(num_decode_rows, first + 1, dtype=np.int64), chunks])
        row = np.repeat(np.arange(B), n)
        positions = np.arange(num_tokens) - qsl[:-1][row]
        positions[:num_decode_rows] = first
        table = np.tile(np.arange(-(-(first + 1) // block_size), dtype=np.int64), (B, 1))
        return cls([f"warm-up-{i}" for i in range(B)], [], n, qsl, seq_lens, np.zeros(num_tokens, dtype=np.int64),
                   positions, row, [table] * num_groups, [])

    @classmethod
    def empty(cls, num_groups: int) -> "StepBatch":
        """No sequence at all (every row of a padded upload is then padding)."""
        none = np.zeros(0, dtype=np.int64)
        return cls([], [], none, np.zeros(1, dtype=np.int64), none, none, none, none,
                   [np.zeros((0, 0), dtype=np.int64)] * num_groups, [])

    def check_pending(self, in_flight_rows: np.ndarray | None) -> None:
        """Async scheduling: every pending input id must be one the step in flight samples
        (in_flight_rows: the runner rows it samples; None when no step is in flight)."""
        if self.pending_src_T is None:
            return
        if in_flight_rows is None:
            raise RuntimeError("a step has inputs from a step in flight, but none was given")
        wanted = self.pending_src_T[self.pending_src_T >= 0]
        sampled = np.zeros(max(int(wanted.max()), int(in_flight_rows.max(initial=0))) + 1, dtype=bool)
        sampled[in_flight_rows] = True  # a mask, not np.isin: that sorts, ~10x the time at 256 rows
        missing = wanted[~sampled[wanted]]
        if len(missing):
            by_row = {int(r): req_id for r, req_id in zip(self.rows_B, self.req_ids)}
            raise RuntimeError(f"requests {[by_row[int(r)] for r in missing]} wait for tokens that the step in "
                               "flight does not sample")

    @functools.cached_property
    def sampling_requests(self) -> tuple[list[str], list[RequestState]]:
        """The ids and states of the sequences in sample_rows: the batch's own lists when every
        sequence samples (sample_rows then is 0..B-1)."""
        if len(self.sample_rows) == len(self.states):
            return self.req_ids, self.states
        return [self.req_ids[i] for i in self.sample_rows], [self.states[i] for i in self.sample_rows]

    def sample_rows_R(self) -> np.ndarray:
        """The runner row of each sequence in sample_rows."""
        return self.rows_B[np.asarray(self.sample_rows, dtype=np.int64)]

    def sample_token_rows(self) -> np.ndarray:
        """The token row (its last of the step) of each sequence in sample_rows."""
        return self.query_start_loc[np.asarray(self.sample_rows, dtype=np.int64) + 1] - 1

    def slots(self, group: int, block_size: int) -> np.ndarray:
        """Cache slot of each token through one group's block table (-1, none, in the recurrent group)."""
        if group == self.state_group:
            return np.full(len(self.positions_T), -1, dtype=np.int64)
        if self.tables is not None:
            table, row_T = self.tables[group], self.row_T
        else:  # straight from the runner's table: no [B, m] gather
            table, row_T = self.source.tables[group], self.rows_B[self.row_T]
        return table[row_T, self.positions_T // block_size] * block_size + self.positions_T % block_size


def host_metadata(batch: StepBatch, device: torch.device, block_size: int, device_fields: bool) -> AttentionMetadata:
    """Metadata as fresh tensors (the torch reference path); `device_fields` adds the GPU kernels'
    layout too (a GPU step that does not fit the step buffers)."""
    qsl, seq_lens = batch.query_start_loc, batch.seq_lens_B
    decode = np.nonzero(batch.num_tokens_B == 1)[0]
    layout = dict(query_start_loc=qsl.tolist(), seq_lens=seq_lens.tolist(), decode_seqs=decode.tolist(),
                  prefill_seqs=np.nonzero(batch.num_tokens_B != 1)[0].tolist())
    metas = [AttentionMetadata(block_tables_BM=host_to_device(batch.block_table(g), device),
                               slot_mapping_T=host_to_device(batch.slots(g, block_size), device), **layout)
             for g in range(batch.num_groups)]
    _add_decode_rows(metas, batch, device, block_size)
    if device_fields:
        for meta in metas:
            meta.query_start_loc_t = host_to_device(qsl.astype(np.int32), device)
            meta.seq_lens_t = host_to_device(seq_lens.astype(np.int32), device)
            meta.max_query_len, meta.decode_only = int(batch.num_tokens_B.max()), batch.decode_only
    return _grouped(metas)


def upload(buf: StepBuffers, batch: StepBatch, block_size: int, padded: tuple[int, int] | None = None,
           metadata: bool = True, num_valid: int | None = None) -> AttentionMetadata | None:
    """Write the batch into the step buffers, upload it, and return metadata over the device views
    (None without `metadata`: a CUDA graph's replay reads the buffers, not the metadata). num_valid:
    the expert-load counters' count of real rows, when they read it from the buffers.

    padded: (tokens t, sequences b) of a CUDA graph the step replays. Sequences B..b-1 are padding
    of context 0 (attention reads nothing and writes zeros): each takes one of the padding tokens
    T..t-1 (slot -1, position 0) while more than one padding sequence is left, the last takes the
    rest (none, or many in a mixed step's graph)."""
    T, B = len(batch.input_ids_T), len(batch.req_ids)
    t, b = padded if padded else (T, B)
    if t < T or b < B or (t > T and b == B):
        raise ValueError(f"a step of {T} tokens in {B} sequences cannot pad to {t} tokens in {b} sequences")
    buf.begin()
    sizes = {"input_ids": t, "pending_src": t, "positions": t, "query_start_loc": b + 1, "seq_lens": b}
    if num_valid is not None:
        buf.host_view("num_valid", 1)[0] = num_valid
        sizes["num_valid"] = 1
    _fill(buf.host_view("input_ids", t), batch.input_ids_T, 0)
    _fill(buf.host_view("pending_src", t), () if batch.pending_src_T is None else batch.pending_src_T, -1)
    _fill(buf.host_view("positions", t), batch.positions_T, 0)
    qsl = buf.host_view("query_start_loc", b + 1)
    qsl[:B + 1] = batch.query_start_loc
    ones = max(0, min(b - B - 1, t - T))  # padding sequences of one token each; the last holds the rest
    qsl[B + 1:B + 1 + ones] = T + np.arange(1, ones + 1)
    qsl[B + 1 + ones:] = t
    _fill(buf.host_view("seq_lens", b), batch.seq_lens_B, 0)
    sample_idx = batch.sample_token_rows()
    # a graph's LM head reads min(t, b) rows (ModelRunner._with_logits): its padding ones read token 0
    num_idx = min(t, b) if padded else len(sample_idx)
    _fill(buf.host_view("sample_idx", num_idx), sample_idx, 0)
    sizes["sample_idx"] = num_idx
    if batch.sample_rows:
        buf.host_view("sample_rows", len(sample_idx))[:] = batch.sample_rows_R()
        sizes["sample_rows"] = len(sample_idx)
    for g in range(batch.num_groups):
        _fill(buf.host_view(f"slots{g}", t), batch.slots(g, block_size), -1)
        sizes[f"slots{g}"] = t
    num_writes = _stage_tables(buf, batch, b, sizes)
    buf.upload(sizes)
    buf.apply_table_writes(num_writes)
    if not metadata:
        return None  # the graph gathers the block tables itself
    buf.gather_tables(b)
    meta = buffer_metadata(buf, batch.num_groups, t, b, int(batch.num_tokens_B.max(initial=1)),
                           batch.query_start_loc.tolist(), batch.seq_lens_B.tolist(), batch.decode_only)
    if not batch.decode_only and not padded:  # an eager mixed batch: its decode rows for MLA's absorbed path
        _add_decode_rows(meta.group_metas or [meta], batch, buf.device, block_size)
    return meta


def _stage_tables(buf: StepBuffers, batch: StepBatch, b: int, sizes: dict[str, int]) -> int:
    """Each sequence's row of the device block tables and the writes that bring them up to date:
    the blocks the runner's tables gained since the last upload, or a synthetic batch's whole
    tables, into scratch rows. Padding sequences (context 0, nothing read) take row 0."""
    B = len(batch.req_ids)
    rows = buf.host_view("table_rows", b)
    if batch.source is not None:
        if B and int(batch.rows_B.max()) >= buf.runner_rows:
            raise RuntimeError(f"runner row {int(batch.rows_B.max())} is past the {buf.runner_rows} rows of the "
                               "device block tables")
        rows[:B] = batch.rows_B + buf.max_seqs
        writes, scratch = batch.source.take_writes(), False
    else:
        rows[:B] = np.arange(B)
        writes, scratch = [(g, i, 0, table[i]) for g, table in enumerate(batch.tables) for i in range(B)], True
    rows[B:] = 0
    sizes["table_rows"] = b
    return buf.stage_table_writes(writes, scratch, sizes)


def buffer_metadata(buf: StepBuffers, num_groups: int, t: int, b: int, max_query_len: int, qsl: list[int],
                    seq_lens: list[int], decode_only: bool, host_lists: bool = True) -> AttentionMetadata:
    """Metadata over the first t tokens and b sequences of the step buffers (what a CUDA graph
    captures: the same views are read at every replay). host_lists=False: qsl and seq_lens are a
    graph's placeholders (AttentionMetadata.host_lists)."""
    if decode_only:
        decode, prefill = list(range(len(seq_lens))), []
    else:
        decode = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] == 1]
        prefill = [i for i in range(len(seq_lens)) if qsl[i + 1] - qsl[i] != 1]
    qsl_t, seq_lens_t = buf.dev_view("query_start_loc", b + 1), buf.dev_view("seq_lens", b)
    metas = [AttentionMetadata(qsl, seq_lens, buf.tables[g][:b], buf.dev_view(f"slots{g}", t), decode, prefill,
                               query_start_loc_t=qsl_t, seq_lens_t=seq_lens_t, max_query_len=max_query_len,
                               decode_only=decode_only, host_lists=host_lists)
             for g in range(num_groups)]
    return _grouped(metas)


def _add_decode_rows(metas: list[AttentionMetadata], batch: StepBatch, device: torch.device,
                     block_size: int) -> None:
    """The decode sequences' token rows, context lengths and block tables (cut to their longest
    context), which the torch reference and MLA's absorbed path batch together."""
    decode = np.nonzero(batch.num_tokens_B == 1)[0]
    if not len(decode):
        return
    nblk = -(-int(batch.seq_lens_B[decode].max()) // block_size)
    for g, meta in enumerate(metas):
        table = batch.block_table(g)
        meta.decode_token_idx = host_to_device(batch.query_start_loc[decode], device)
        meta.decode_seq_lens = host_to_device(batch.seq_lens_B[decode], device)
        meta.decode_block_tables = host_to_device(np.ascontiguousarray(table[decode, :nblk]), device)


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
