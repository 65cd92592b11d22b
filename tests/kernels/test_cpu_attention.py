"""The batched CPU attention (kernels/cpu_attention.py) against the reference paged_attention_torch:
mixed batches, fresh prefills of mixed lengths (padded groups), decodes of mixed context lengths
(grouped reads), chunked-local masks, GQA and MHA."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import paged_attention_torch
from kernels.cpu_attention import _groups, paged_attention_cpu
from tests.kernels.attention_cases import paged_batch


def _check(seqs, block_size, chunk, **kw):
    b = paged_batch(seqs, block_size, stale_cache=True, **kw)
    q, k, v, cache, meta, scale = b.q, b.k_new, b.v_new, b.cache, b.meta, b.scale
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
