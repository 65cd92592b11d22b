"""Paged attention (torch reference) against a dense masked softmax, global and chunked-local."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention_torch
from tests.kernels.attention_cases import paged_batch

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
    batch = paged_batch(seqs, block_size, H, G, D, seed)
    refs = [_dense_reference(q, k, v, k.shape[0], batch.scale, chunk) for q, k, v in batch.contexts]
    args = (batch.q, batch.k_new, batch.v_new, batch.cache, batch.meta, batch.scale)
    if chunk is None:
        out = paged_attention_torch(*args)  # the original signature
    else:
        out = paged_attention_torch(*args, chunk_size=chunk)
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
