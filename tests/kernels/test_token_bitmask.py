"""The grammar-mask Triton kernel against its torch reference (the interpreter on the CPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.token_bitmask import apply_token_bitmask_reference
from tests.kernels.triton_marks import DEV, needs_triton_device


@needs_triton_device
@pytest.mark.parametrize("V", [33, 4097, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(V, dtype):
    from kernels.triton_fused.token_bitmask import apply_token_bitmask_triton

    gen = torch.Generator().manual_seed(V)
    B, W = 5, -(-V // 32) + 1  # a spare word: bits past V are ignored
    logits = torch.randn(B, V + 3, generator=gen).to(dtype).to(DEV)[:, :V]  # a row stride past V
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, W), dtype=torch.int64, generator=gen).to(torch.int32).to(DEV)
    rows = torch.tensor([4, 0, 2], device=DEV)
    want, got = logits.clone(), logits.clone()
    apply_token_bitmask_reference(want, rows, bitmask)
    apply_token_bitmask_triton(got, rows, bitmask)
    assert torch.equal(got, want)
    assert torch.isinf(got[rows]).any() and torch.equal(got[[1, 3]], logits[[1, 3]])
