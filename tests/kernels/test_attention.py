"""Paged attention (torch reference) against a dense masked softmax, global and chunked-local."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention_torch, write_kv_cache

H, G, D = 4, 2, 8


def _dense_reference(q_nHd, k_LGd, v_LGd, L: int, scale: float, chunk: int | None) -> torch.Tensor:
    """Query i at position L - n + i sees key j iff j <= pos (and same chunk when chunked)."""
    n = q_nHd.shape[0]
    k = k_LGd.repeat_interleave(H // G, dim=1)  # [L, H, d]
    v = v_LGd.repeat_interleave(H // G, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q_nHd.double(), k.double()) * scale
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None, :]
    allowed = kpos <= qpos
    if chunk is not None:
        allowed &= (kpos // chunk) == (qpos // chunk)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v.double()).float()


def _run(seqs: list[tuple[int, int]], block_size: int, chunk: int | None, seed: int = 0):
    """seqs: (cached tokens, new tokens) per sequence. Returns (paged output, dense reference)."""
    gen = torch.Generator().manual_seed(seed)
    nblk_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(nblk_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered over the cache
    cache = torch.zeros(2, num_blocks, block_size, G, D)
    tables = torch.zeros(len(seqs), max(nblk_per_seq), dtype=torch.int64)
    qs, ks, vs, slots, refs, qsl, seq_lens = [], [], [], [], [], [0], []
    scale = D ** -0.5
    for b, (c, n) in enumerate(seqs):
        L = c + n
        blocks = [perm.pop() for _ in range(nblk_per_seq[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks)
        k = torch.randn(L, G, D, generator=gen)
        v = torch.randn(L, G, D, generator=gen)
        q = torch.randn(n, H, D, generator=gen)
        slot = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(L)])
        write_kv_cache(k[:c], v[:c], cache, slot[:c])  # context cached by earlier steps
        qs.append(q), ks.append(k[c:]), vs.append(v[c:]), slots.append(slot[c:])
        refs.append(_dense_reference(q, k, v, L, scale, chunk))
        qsl.append(qsl[-1] + n)
        seq_lens.append(L)
    q, k_new, v_new, slot_mapping = torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(slots)
    decode = [b for b, (_, n) in enumerate(seqs) if n == 1]
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=seq_lens, block_tables_BM=tables,
                             slot_mapping_T=slot_mapping, decode_seqs=decode,
                             prefill_seqs=[b for b in range(len(seqs)) if b not in decode])
    if decode:  # as the model runner prepares them
        nblk = -(-max(seq_lens[b] for b in decode) // block_size)
        meta.decode_token_idx = torch.tensor([qsl[b] for b in decode])
        meta.decode_seq_lens = torch.tensor([seq_lens[b] for b in decode])
        meta.decode_block_tables = tables[decode, :nblk].contiguous()
    write_kv_cache(k_new, v_new, cache, slot_mapping)
    if chunk is None:
        out = paged_attention_torch(q, k_new, v_new, cache, meta, scale)  # the original signature
    else:
        out = paged_attention_torch(q, k_new, v_new, cache, meta, scale, chunk_size=chunk)
    return out, torch.cat(refs)


# (cached, new): fresh prefills, prefills on cached context that start mid-chunk, cross one or
# several chunk boundaries or start exactly on one; decodes at a chunk's first and last position.
MIXED = [(0, 1), (0, 11), (9, 7), (5, 12), (16, 5), (3, 26), (15, 1), (16, 1), (23, 1), (7, 1), (0, 1)]


@pytest.mark.parametrize("chunk", [None, 3, 8])
@pytest.mark.parametrize("block_size", [4, 5])
def test_mixed_batch_matches_dense(chunk, block_size):
    """block 5 / chunk 3 or 8: chunk boundaries fall inside blocks; block 4 / chunk 8: on them."""
    out, ref = _run(MIXED, block_size, chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [
    [(c, 1) for c in range(0, 20)],          # decode only, every position mod the chunk
    [(c, 4) for c in range(0, 20, 3)],       # prefill only, on every offset into a chunk
])
def test_decode_only_and_prefill_only(seqs):
    out, ref = _run(seqs, block_size=4, chunk=6, seed=1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_chunk_larger_than_context_is_global():
    out_chunked, _ = _run(MIXED, block_size=4, chunk=64, seed=2)
    out_global, _ = _run(MIXED, block_size=4, chunk=None, seed=2)
    torch.testing.assert_close(out_chunked, out_global)


def test_chunked_differs_from_global():
    """The chunk mask really drops the earlier chunks' keys."""
    out_chunked, _ = _run([(13, 4), (17, 1)], block_size=4, chunk=8)
    out_global, _ = _run([(13, 4), (17, 1)], block_size=4, chunk=None)
    assert (out_chunked - out_global).abs().max() > 1e-2
