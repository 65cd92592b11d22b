"""The batch-invariant mode's kernels (kernels/batch_invariant.py): each matches its ordinary
counterpart, and a row's result is bit-identical whatever rows share the call and wherever it
sits. The Triton ones run under TRITON_INTERPRET=1 without a GPU (tiny shapes), on the GPU with one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import batch_invariant
from kernels.attention import paged_attention_torch
from tests.kernels.attention_cases import paged_batch
from tests.kernels.test_unified_attention import device_args
from tests.kernels.triton_marks import DEV, needs_triton_device


@pytest.fixture
def mode_on():
    previous = batch_invariant.set_enabled(True)
    yield
    batch_invariant.set_enabled(previous)


def _row_everywhere(fn, x, row_count_and_places):
    """fn's row for x[0] computed alone, then among the other rows of x at each (count, place)."""
    alone = fn(x[:1])[0]
    return alone, [fn(torch.cat([x[1:p + 1], x[:1], x[p + 1:m]]))[p] for m, p in row_count_and_places]


PLACES = [(2, 1), (7, 3), (33, 0), (33, 32), (70, 41)]


def test_cpu_linear_rows_are_invariant_and_match_f_linear(mode_on):
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, 96, generator=gen), torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    torch.testing.assert_close(batch_invariant.linear(x, w, b), F.linear(x, w, b))
    alone, placed = _row_everywhere(lambda t: batch_invariant.linear(t, w, b), x, PLACES)
    assert all(torch.equal(alone, r) for r in placed)


def test_cpu_pointwise_rows_are_invariant(mode_on):
    x = torch.randn(70, 33, generator=torch.Generator().manual_seed(1))
    for fn in (F.silu, torch.sigmoid, torch.exp):
        # The values are fn's up to its rounding: in some processes of a full run on this project's CPUs, torch.exp
        # of the [70, 33] tensor and of the padded one differed by up to 1.5e-4 relative (not reproduced alone).
        torch.testing.assert_close(batch_invariant.pointwise(fn, x), fn(x), rtol=1e-3, atol=1e-5)
        alone, placed = _row_everywhere(lambda t: batch_invariant.pointwise(fn, t), x, PLACES)
        assert all(torch.equal(alone, r) for r in placed), fn


@pytest.mark.parametrize("local", [{}, {"chunk_size": 8}, {"sliding_window": 5}, {"sinks": True}])
def test_cpu_attention_matches_the_reference_and_each_query_is_its_own(local):
    """The same sequence's last query alone (a decode row) and at the end of a 7-token chunk beside
    other sequences: bit-identical; the whole batch equals the reference."""
    kw = dict(local)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mixed = paged_batch([(15, 1), (20, 7), (0, 5)], block_size=4, seed=3)
    out = batch_invariant.paged_attention_invariant(mixed.q, mixed.k_new, mixed.v_new, mixed.cache, mixed.meta, 0.3,
                                                    **kw)
    ref = paged_attention_torch(mixed.q, mixed.k_new, mixed.v_new, mixed.cache, mixed.meta, 0.3, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # Sequence 1's last query (position 26) as a decode row of its own over the same cache.
    decode = paged_batch([(26, 1)], block_size=4, seed=3)
    meta = decode.meta
    meta.block_tables_BM = mixed.meta.block_tables_BM[1:2]
    q_last = mixed.q[mixed.meta.query_start_loc[2] - 1:mixed.meta.query_start_loc[2]]
    alone = batch_invariant.paged_attention_invariant(q_last, None, None, mixed.cache, meta, 0.3, **kw)
    assert torch.equal(alone[0], out[mixed.meta.query_start_loc[2] - 1])


@needs_triton_device
def test_triton_gemm_matches_f_linear_and_rows_are_invariant():
    from kernels.triton_fused.invariant_gemm import invariant_linear_triton

    gen = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(70, 80, generator=gen).to(DEV), torch.randn(72, 80, generator=gen).to(DEV),
               torch.randn(72, generator=gen).to(DEV))
    torch.testing.assert_close(invariant_linear_triton(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    assert invariant_linear_triton(x[:0], w).shape == (0, 72)
    if DEV == "cuda":  # the interpreter's numpy dot is not itself row-invariant; the kernel's tiling is
        alone, placed = _row_everywhere(lambda t: invariant_linear_triton(t, w, b), x, PLACES)
        assert all(torch.equal(alone, r) for r in placed)
    with pytest.raises(ValueError, match="do not match"):
        invariant_linear_triton(x, w[:, :8])


@needs_triton_device
@pytest.mark.parametrize("local", [{}, {"chunk_size": 8}, {"sliding_window": 5}])
def test_unified_invariant_decode_row_equals_the_same_query_in_a_chunk(local):
    from kernels.triton_attention.unified import unified_attention_triton

    mixed = paged_batch([(15, 1), (20, 7), (0, 5)], block_size=4, seed=3)
    q, cache, tables, qsl, lens = device_args(mixed, torch.float32)
    kw = dict(local, config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}, invariant=True)
    out = unified_attention_triton(q, cache, tables, qsl, lens, 0.3, **kw)
    ref = paged_attention_torch(mixed.q, mixed.k_new, mixed.v_new, mixed.cache, mixed.meta, 0.3, **local)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    last = mixed.meta.query_start_loc[2] - 1
    alone = unified_attention_triton(q[last:last + 1], cache, tables[1:2],
                                     torch.tensor([0, 1], dtype=torch.int32, device=DEV), lens[1:2], 0.3, **kw)
    assert torch.equal(alone[0], out[last])
