"""Token alignment for the grouped expert GEMMs, on the GPU and without a host synchronisation.

Legend: T tokens, K top-k, E local experts, R = T*K flattened (token, slot) rows, BM = BLOCK_M.

The flattened top-k ids are sorted by expert and each expert's rows are padded to a multiple of
BM, so that every BM-row block of the sorted order belongs to exactly one expert:

    sorted_ids_P   [P] int32  flat row index r = t*K + k, or the sentinel R in the padding
    expert_ids_B   [B] int32  local expert of each block; -1 for experts not on this rank
                              (rows whose expert_map entry is -1) and for unused tail blocks
    num_post_pad_1 [1] int32  number of used rows (a multiple of BM); blocks past it are skipped

Rows whose expert lives elsewhere are kept in an extra bucket E with expert id -1, so that the
down GEMM can write their (zero) output and every flat row is produced exactly once.

P and B depend only on shapes (never on the data), so the whole thing is CUDA-graph capturable:
    P = R + min(R, E + 1) * (BM - 1),  B = ceil(P / BM)
(at most min(R, E+1) buckets are non-empty and each wastes at most BM-1 rows).

Three paths (auto_path chooses): one program for small R (a single launch); "ranked", one launch
of many programs, for decode batches of 64 tokens and more and moderate prefills; count -> prefix
-> scatter kernels for very large R. The one program and the scatter place rows with atomics, so
the order within an expert is arbitrary, which does not change any row's result; the ranked path
keeps the reference's order.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

SMALL_CHUNK_ROWS = 4096  # rows the one-program path holds at a time
# path="auto" (measured on an H200, BENCHMARKS.md §1): the one program is the faster in GPU
# time at 2048 rows (11.1 µs against 12.6), the slower at 8192 (29.9 against 12.6). Called
# eagerly from an idle GPU the one launch instead of four looked better up to 65536 rows, but
# inside the engine the launches queue behind the GPU's work and only GPU time counts: a prefill
# step of 8192 tokens x top-8 (65536 rows) spent 262 µs per layer aligning on the one program.
AUTO_SMALL_ROWS = 4096
# The ranked path's programs: each places up to RANKED_CHUNK_ROWS rows (a [CHUNK, CHUNK]
# comparison) and fills up to RANKED_MAX_BLOCKS blocks (a [blocks, bins] comparison), so that
# neither spills registers.
RANKED_CHUNK_ROWS = 64
RANKED_MAX_BLOCKS = 16
# From this many rows up to AUTO_SMALL_ROWS auto takes the ranked path: in CUDA-graph replay on an
# H200 (Qwen3-30B-A3B, top-8; BENCHMARKS.md §1) it took 3.9 against 4.2 µs at 512 rows and 5.4
# against 10.5 at 2048, but 3.6 against 3.3 at 256. MOE_ALIGN_RANKED=0: never (A/B runs).
RANKED_MIN_ROWS = 512 if os.environ.get("MOE_ALIGN_RANKED", "1") != "0" else AUTO_SMALL_ROWS + 1


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """Worst-case P for R rows over E local experts (plus the 'elsewhere' bucket)."""
    return num_rows + min(num_rows, num_experts + 1) * (block_m - 1)


def _num_bins(num_experts: int) -> int:
    # E real buckets, one 'elsewhere' bucket (E) and at least one junk bin for masked lanes.
    return triton.next_power_of_2(num_experts + 2)


@triton.jit
def _bucket_of(ids_ptr, emap_ptr, offs, mask, E, NB: tl.constexpr, HAS_MAP: tl.constexpr):
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    if HAS_MAP:
        ids = tl.load(emap_ptr + ids, mask=mask, other=-1).to(tl.int32)
    b = tl.where(ids < 0, E, ids)
    return tl.where(mask, b, NB - 1)


@triton.jit
def _fill_blocks(sorted_ptr, expert_ids_ptr, j, jmask, starts, counts, ends, total, E, sentinel,
                 NB: tl.constexpr, BLOCK_M: tl.constexpr):
    """Expert id of blocks j and sentinels in their padding rows (never a real row's slot)."""
    bins = tl.arange(0, NB)
    row0 = j * BLOCK_M
    # a block belongs to the first bucket whose end lies beyond its first row
    bidx = tl.sum((ends[None, :] <= row0[:, None]).to(tl.int32), axis=1)
    eid = tl.where((bidx < E) & (row0 < total), bidx, -1)
    tl.store(expert_ids_ptr + j, eid, mask=jmask)
    onehot = bins[None, :] == bidx[:, None]
    real_end = tl.sum(tl.where(onehot, (starts + counts)[None, :], 0), axis=1)
    r = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = jmask[:, None] & (r >= real_end[:, None])
    tl.store(sorted_ptr + r, tl.zeros_like(r) + sentinel, mask=pad)


@triton.jit(do_not_specialize=["numel", "num_rows_padded", "num_blocks"])  # token counts: one variant for any step
def _align_small_kernel(ids_ptr, emap_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, cursor_ptr,
                        numel, E, num_rows_padded, num_blocks,
                        BLOCK_M: tl.constexpr, NB: tl.constexpr, RP: tl.constexpr,
                        BP: tl.constexpr, CHUNK: tl.constexpr, HAS_MAP: tl.constexpr, USE_PDL: tl.constexpr):
    """One program, RP rows at a time: histogram -> padded prefix -> block experts from a
    histogram of the buckets' end blocks -> sentinels -> rows scattered by atomics on a cursor
    per bucket (order within an expert arbitrary)."""
    pdl_enter(USE_PDL)
    bins = tl.arange(0, NB)
    counts = tl.zeros([NB], dtype=tl.int32)
    for start in range(0, numel, RP):
        offs = start + tl.arange(0, RP)
        counts += tl.histogram(_bucket_of(ids_ptr, emap_ptr, offs, offs < numel, E, NB, HAS_MAP), NB)
    counts = tl.where(bins <= E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(npp_ptr, total)
    # Block j belongs to the bucket whose block range holds it = the number of buckets that end
    # at or before block j (empty buckets included); past `total` it is unused (-1).
    j = tl.arange(0, BP)
    bidx = tl.cumsum(tl.histogram(ends // BLOCK_M, BP), axis=0)
    eid = tl.where((bidx < E) & (j * BLOCK_M < total), bidx, -1)
    tl.store(expert_ids_ptr + j, eid, mask=j < num_blocks)
    for start in range(0, num_rows_padded, CHUNK):  # sentinels first, real rows over them
        r = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, tl.zeros_like(r) + numel, mask=r < num_rows_padded)
    tl.store(cursor_ptr + bins, ends - padded)
    tl.debug_barrier()  # the sentinels and the cursors are visible to every thread
    for start in range(0, numel, RP):
        offs = start + tl.arange(0, RP)
        m = offs < numel
        pos = tl.atomic_add(cursor_ptr + _bucket_of(ids_ptr, emap_ptr, offs, m, E, NB, HAS_MAP), 1,
                            mask=m)
        tl.store(sorted_ptr + pos, offs, mask=m)


@triton.jit(do_not_specialize=["numel", "num_blocks", "blocks_per_prog"])  # token counts: one variant for any step
def _align_ranked_kernel(ids_ptr, emap_ptr, sorted_ptr, expert_ids_ptr, npp_ptr, base_ptr,
                         numel, E, num_blocks, blocks_per_prog,
                         BLOCK_M: tl.constexpr, NB: tl.constexpr, RP: tl.constexpr, CHUNK: tl.constexpr,
                         BPP: tl.constexpr, HAS_MAP: tl.constexpr, USE_PDL: tl.constexpr):
    """Many programs, no atomics: each reads every id (a few KiB, from L2) for the bucket counts
    and for the counts of the rows before its CHUNK, ranks its rows within their bucket by
    comparing them with each other, and writes them to bucket start + earlier rows + rank (the
    reference's stable order); it also writes the expert ids and padding sentinels of its
    (at most BPP) blocks. base_ptr: [programs, NB] int32 scratch for the per-bucket bases."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    bins = tl.arange(0, NB)
    first = pid * CHUNK
    counts = tl.zeros([NB], dtype=tl.int32)
    before = tl.zeros([NB], dtype=tl.int32)
    for start in range(0, numel, RP):
        offs = start + tl.arange(0, RP)
        b = _bucket_of(ids_ptr, emap_ptr, offs, offs < numel, E, NB, HAS_MAP)
        counts += tl.histogram(b, NB)
        before += tl.histogram(tl.where(offs < first, b, NB - 1), NB)
    counts = tl.where(bins <= E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    if pid == 0:
        tl.store(npp_ptr, total)
    # This program's rows: slot = start of its bucket + its bucket's rows in earlier chunks +
    # the rows of its bucket before it in this chunk (the bases go through scratch: a gather by
    # bucket from registers would be a [CHUNK, NB] one-hot).
    my_base = base_ptr + pid * NB
    tl.store(my_base + bins, starts + before)
    tl.debug_barrier()  # every thread's bases are visible to the others
    i = tl.arange(0, CHUNK)
    offs = first + i
    m = offs < numel
    b = _bucket_of(ids_ptr, emap_ptr, offs, m, E, NB, HAS_MAP)
    rank = tl.sum(((b[None, :] == b[:, None]) & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    base = tl.load(my_base + b, mask=m, other=0)
    tl.store(sorted_ptr + base + rank, offs, mask=m)
    j = pid * blocks_per_prog + tl.arange(0, BPP)
    jmask = (tl.arange(0, BPP) < blocks_per_prog) & (j < num_blocks)
    _fill_blocks(sorted_ptr, expert_ids_ptr, j, jmask, starts, counts, ends, total, E, numel, NB, BLOCK_M)


@triton.jit(do_not_specialize=["numel"])  # token counts: one variant for any step
def _align_count_kernel(ids_ptr, emap_ptr, counts_ptr, numel, E,
                        NB: tl.constexpr, CHUNK: tl.constexpr, HAS_MAP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    b = _bucket_of(ids_ptr, emap_ptr, offs, offs < numel, E, NB, HAS_MAP)
    hist = tl.histogram(b, NB)
    tl.atomic_add(counts_ptr + tl.arange(0, NB), hist, mask=hist > 0)


@triton.jit
def _align_prefix_kernel(counts_ptr, npp_ptr, E, BLOCK_M: tl.constexpr, NB: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    # counts_ptr holds [counts | cursor | starts | ends], NB each; cursor starts at the bucket start
    bins = tl.arange(0, NB)
    counts = tl.load(counts_ptr + bins)
    counts = tl.where(bins <= E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(counts_ptr + bins, counts)
    tl.store(counts_ptr + NB + bins, starts)
    tl.store(counts_ptr + 2 * NB + bins, starts)
    tl.store(counts_ptr + 3 * NB + bins, ends)
    tl.store(npp_ptr, tl.sum(padded, axis=0))


@triton.jit(do_not_specialize=["numel", "max_blocks", "num_scatter_progs"])  # token counts: one variant for any step
def _align_scatter_kernel(ids_ptr, emap_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, npp_ptr,
                          numel, E, max_blocks, num_scatter_progs,
                          BLOCK_M: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr,
                          BLK_CHUNK: tl.constexpr, HAS_MAP: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    if pid < num_scatter_progs:
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        m = offs < numel
        b = _bucket_of(ids_ptr, emap_ptr, offs, m, E, NB, HAS_MAP)
        pos = tl.atomic_add(counts_ptr + NB + b, 1, mask=m)
        tl.store(sorted_ptr + pos, offs, mask=m)
    else:
        bins = tl.arange(0, NB)
        counts = tl.load(counts_ptr + bins)
        starts = tl.load(counts_ptr + 2 * NB + bins)
        ends = tl.load(counts_ptr + 3 * NB + bins)
        total = tl.load(npp_ptr)
        j = (pid - num_scatter_progs) * BLK_CHUNK + tl.arange(0, BLK_CHUNK)
        _fill_blocks(sorted_ptr, expert_ids_ptr, j, j < max_blocks, starts, counts, ends, total,
                     E, numel, NB, BLOCK_M)


def auto_path(num_rows: int, num_blocks: int) -> str:
    """The alignment path for `num_rows` rows: see AUTO_SMALL_ROWS."""
    # the one program also holds a histogram over every block
    if num_rows > AUTO_SMALL_ROWS or num_blocks >= 16384:
        return "large"
    return "ranked" if num_rows >= RANKED_MIN_ROWS else "small"


def align_tokens(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int,
                 expert_map_E: torch.Tensor | None = None, path: str = "auto"):
    """Sort (token, slot) rows by local expert and pad each expert to `block_m` rows.

    Args:
        topk_ids_TK: [T, K] int expert ids (global when `expert_map_E` is given, else local).
        num_experts: E, the number of local experts.
        block_m: BM, rows per block of the grouped GEMM.
        expert_map_E: optional [E_global] int, global -> local id, -1 = not on this rank.
        path: "ranked" (one launch of many programs), "small" (one program), "large"
            (count/prefix/scatter) or "auto".
    Returns:
        (sorted_ids_P int32, expert_ids_B int32, num_post_pad_1 int32), see the module docstring.
    """
    ids = topk_ids_TK.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    numel = ids.numel()
    dev = ids.device
    P = max_padded_rows(numel, num_experts, block_m)
    B = triton.cdiv(P, block_m)
    P = B * block_m
    NB = _num_bins(num_experts)
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(B, dtype=torch.int32, device=dev)
    npp = torch.empty(1, dtype=torch.int32, device=dev)
    has_map = expert_map_E is not None
    emap = expert_map_E if has_map else ids
    blk_chunk = max(1, min(64, 8192 // (NB * 2)))
    if path == "auto":
        path = auto_path(numel, B)
    rp = min(triton.next_power_of_2(max(numel, 16)), SMALL_CHUNK_ROWS)  # ids read at a time (one program, ranked)
    if path == "ranked":
        chunk = RANKED_CHUNK_ROWS
        progs = max(triton.cdiv(numel, chunk), triton.cdiv(B, RANKED_MAX_BLOCKS))
        per_prog = triton.cdiv(B, progs)
        bases = torch.empty(progs, NB, dtype=torch.int32, device=dev)
        _align_ranked_kernel[(progs,)](ids, emap, sorted_ids, expert_ids, npp, bases, numel, num_experts, B,
                                       per_prog, BLOCK_M=block_m, NB=NB,
                                       RP=rp,
                                       CHUNK=chunk, BPP=triton.next_power_of_2(per_prog), HAS_MAP=has_map,
                                       num_warps=4, **pdl_launch(ids))
        return sorted_ids, expert_ids, npp
    if path == "small":
        cursor = torch.empty(NB, dtype=torch.int32, device=dev)
        _align_small_kernel[(1,)](ids, emap, sorted_ids, expert_ids, npp, cursor, numel,
                                  num_experts, P, B, BLOCK_M=block_m, NB=NB,
                                  RP=rp,
                                  BP=triton.next_power_of_2(B + 1), CHUNK=4096,
                                  HAS_MAP=has_map, num_warps=8, **pdl_launch(ids))
        return sorted_ids, expert_ids, npp
    chunk = 1024
    counts = torch.zeros(4 * NB, dtype=torch.int32, device=dev)
    n_chunks = triton.cdiv(numel, chunk)
    _align_count_kernel[(n_chunks,)](ids, emap, counts, numel, num_experts, NB=NB, CHUNK=chunk,
                                     HAS_MAP=has_map, num_warps=4, **pdl_launch(ids))
    _align_prefix_kernel[(1,)](counts, npp, num_experts, BLOCK_M=block_m, NB=NB, num_warps=4, **pdl_launch(ids))
    grid = (n_chunks + triton.cdiv(B, blk_chunk),)
    _align_scatter_kernel[grid](ids, emap, counts, sorted_ids, expert_ids, npp, numel,
                                num_experts, B, n_chunks, BLOCK_M=block_m, NB=NB, CHUNK=chunk,
                                BLK_CHUNK=blk_chunk, HAS_MAP=has_map, num_warps=4, **pdl_launch(ids))
    return sorted_ids, expert_ids, npp


def align_tokens_torch(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int,
                       expert_map_E: torch.Tensor | None = None):
    """Reference of :func:`align_tokens` (host-synchronising; stable order within an expert)."""
    ids = topk_ids_TK.reshape(-1).long()
    if expert_map_E is not None:
        ids = expert_map_E.long()[ids]
    numel = ids.numel()
    bucket = torch.where(ids < 0, torch.full_like(ids, num_experts), ids)
    P = max_padded_rows(numel, num_experts, block_m)
    B = -(-P // block_m)
    sorted_ids = torch.full((B * block_m,), numel, dtype=torch.int32)
    expert_ids = torch.full((B,), -1, dtype=torch.int32)
    pos = 0
    for b in range(num_experts + 1):
        rows = torch.nonzero(bucket.cpu() == b).flatten()
        if rows.numel() == 0:
            continue
        n_pad = -(-rows.numel() // block_m) * block_m
        sorted_ids[pos:pos + rows.numel()] = rows.to(torch.int32)
        expert_ids[pos // block_m:(pos + n_pad) // block_m] = b if b < num_experts else -1
        pos += n_pad
    return sorted_ids, expert_ids, torch.tensor([pos], dtype=torch.int32)
