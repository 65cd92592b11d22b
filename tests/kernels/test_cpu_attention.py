"""The batched CPU attention (kernels/cpu_attention.py) against the reference paged_attention_torch:
mixed batches, fresh prefills of mixed lengths (padded groups), decodes of mixed context lengths
(grouped reads), chunked-local masks, GQA and MHA. Decode rows run the native kernel
(kernels/cpu_native/paged_decode.c) where it builds, and the grouped SDPA otherwise: every case runs
both ways."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.attention import paged_attention_torch
from kernels.cpu_attention import _groups, paged_attention_cpu
from tests.kernels.attention_cases import paged_batch

NATIVE = cpu_native.library() is not None


class _Spy:
    """The native library, counting the decode kernel's calls."""

    def __init__(self, lib):
        self.lib, self.calls = lib, 0

    def moe_paged_decode_f32(self, *args):
        self.calls += 1
        return self.lib.moe_paged_decode_f32(*args)


@pytest.fixture(params=["native", "torch"], autouse=True)
def decode_path(request, monkeypatch):
    if request.param == "native":
        if not NATIVE:
            pytest.skip("no C compiler: the native kernels did not build")
        spy = _Spy(cpu_native.library())
        monkeypatch.setattr(cpu_native, "library", lambda: spy)
        return spy
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    return None


def _check(seqs, block_size, chunk, spy=None, **kw):
    b = paged_batch(seqs, block_size, stale_cache=True, **kw)
    q, k, v, cache, meta, scale = b.q, b.k_new, b.v_new, b.cache, b.meta, b.scale
    ref = paged_attention_torch(q, k, v, cache, meta, scale, chunk_size=chunk)
    calls = spy.calls if spy is not None else 0
    out = paged_attention_cpu(q, k, v, cache, meta, scale, chunk_size=chunk)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if spy is not None and meta.decode_seqs:
        assert spy.calls == calls + 1, "the decode rows ran the native kernel"


MIXED = [(0, 1), (0, 11), (9, 7), (5, 12), (16, 5), (3, 26), (15, 1), (16, 1), (23, 1), (7, 1), (0, 1)]
FRESH = [(0, 32), (0, 31), (0, 30), (0, 7), (0, 7), (0, 7), (0, 2), (0, 1), (0, 19), (0, 32)]
DECODES = [(40, 1), (39, 1), (3, 1), (0, 1), (17, 1), (41, 1), (8, 1), (15, 1), (16, 1)]


@pytest.mark.parametrize("chunk", [None, 3, 8])
@pytest.mark.parametrize("block_size", [4, 5])
@pytest.mark.parametrize("seqs", [MIXED, FRESH, DECODES], ids=["mixed", "fresh", "decodes"])
def test_matches_reference(seqs, block_size, chunk, decode_path):
    _check(seqs, block_size, chunk, decode_path)


def test_equal_lengths_one_call_and_mha(decode_path):
    """The benchmark's shape (every prefill the same length: causal SDPA, no mask), then H == G."""
    _check([(0, 16)] * 6, 16, None, decode_path)
    _check([(0, 16)] * 4, 4, 5, decode_path)  # back to back, one length, under a chunked-local mask
    _check([(0, 9)] * 3 + [(5, 1)] * 3, 4, None, decode_path, H=2, G=2)


def test_long_context_decodes_not_padded_to_the_longest(decode_path):
    """A long and many short decodes form separate groups (each reads only its blocks)."""
    lens = [-(-(c + 1) // 4) for c, _ in [(200, 1)] + [(3, 1)] * 8]
    groups = _groups(lens, lambda w: w)
    assert groups[0] == [0] and sorted(groups[1]) == list(range(1, 9))
    _check([(200, 1)] + [(3, 1)] * 8, 4, None, decode_path)
    _check([(200, 1)] + [(3, 1)] * 8, 4, 16, decode_path)


def test_wide_heads_and_many_query_heads_per_kv_head(decode_path):
    """Qwen3-30B-A3B's ratio (8 query heads per KV head) and head dim 128."""
    _check([(70, 1), (33, 1), (5, 1)], 16, None, decode_path, H=16, G=2, d=128)
