"""The batched CPU attention (kernels/cpu_attention.py) against the reference paged_attention_torch:
mixed batches, fresh prefills of mixed lengths (padded groups), decodes of mixed context lengths
(grouped reads), chunked-local masks, GQA and MHA."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention_torch, write_kv_cache
from kernels.cpu_attention import _groups, paged_attention_cpu


def _batch(seqs: list[tuple[int, int]], block_size: int, H: int = 4, G: int = 2, d: int = 8, seed: int = 0):
    """seqs: (cached tokens, new tokens) per sequence; blocks scattered over the cache, which
    holds every token's K/V after this step. Returns (q, k_new, v_new, cache, meta, scale)."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.randn(2, num_blocks, block_size, G, d, generator=gen)  # stale data where unwritten
    tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int64)
    qs, ks, vs, slots, qsl, seq_lens = [], [], [], [], [0], []
    for b, (c, n) in enumerate(seqs):
        L = c + n
        blocks = [perm.pop() for _ in range(nblk[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks)
        k, v = torch.randn(L, G, d, generator=gen), torch.randn(L, G, d, generator=gen)
        slot = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(L)])
        write_kv_cache(k[:c], v[:c], cache, slot[:c])
        qs.append(torch.randn(n, H, d, generator=gen)), ks.append(k[c:]), vs.append(v[c:]), slots.append(slot[c:])
        qsl.append(qsl[-1] + n)
        seq_lens.append(L)
    q, k_new, v_new, slot_mapping = torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(slots)
    decode = [b for b, (_, n) in enumerate(seqs) if n == 1]
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables_BM=tables,
                             slot_mapping_T=slot_mapping, decode_seqs=decode,
                             prefill_seqs=[b for b in range(len(seqs)) if b not in decode])
    if decode:  # as the model runner prepares them
        width = -(-max(seq_lens[b] for b in decode) // block_size)
        meta.decode_token_idx = torch.tensor([qsl[b] for b in decode])
        meta.decode_seq_lens = torch.tensor([seq_lens[b] for b in decode])
        meta.decode_block_tables = tables[decode, :width].contiguous()
    write_kv_cache(k_new, v_new, cache, slot_mapping)
    return q, k_new, v_new, cache, meta, d ** -0.5


def _check(seqs, block_size, chunk, **kw):
    q, k, v, cache, meta, scale = _batch(seqs, block_size, **kw)
    ref = paged_attention_torch(q, k, v, cache, meta, scale, chunk_size=chunk)
    out = paged_attention_cpu(q, k, v, cache, meta, scale, chunk_size=chunk)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


MIXED = [(0, 1), (0, 11), (9, 7), (5, 12), (16, 5), (3, 26), (15, 1), (16, 1), (23, 1), (7, 1), (0, 1)]
FRESH = [(0, 32), (0, 31), (0, 30), (0, 7), (0, 7), (0, 7), (0, 2), (0, 1), (0, 19), (0, 32)]
DECODES = [(40, 1), (39, 1), (3, 1), (0, 1), (17, 1), (41, 1), (8, 1), (15, 1), (16, 1)]


@pytest.mark.parametrize("chunk", [None, 3, 8])
@pytest.mark.parametrize("block_size", [4, 5])
@pytest.mark.parametrize("seqs", [MIXED, FRESH, DECODES], ids=["mixed", "fresh", "decodes"])
def test_matches_reference(seqs, block_size, chunk):
    _check(seqs, block_size, chunk)


def test_equal_lengths_one_call_and_mha():
    """The benchmark's shape (every prefill the same length: causal SDPA, no mask), then H == G."""
    _check([(0, 16)] * 6, 16, None)
    _check([(0, 9)] * 3 + [(5, 1)] * 3, 4, None, H=2, G=2)


def test_long_context_decodes_not_padded_to_the_longest():
    """A long and many short decodes form separate groups (each reads only its blocks)."""
    lens = [-(-(c + 1) // 4) for c, _ in [(200, 1)] + [(3, 1)] * 8]
    groups = _groups(lens, lambda w: w)
    assert groups[0] == [0] and sorted(groups[1]) == list(range(1, 9))
    _check([(200, 1)] + [(3, 1)] * 8, 4, None)
    _check([(200, 1)] + [(3, 1)] * 8, 4, 16)
