"""MXFP4 dequantisation exactly as transformers does it (every byte and scale), and the fixtures'
quantiser."""
from __future__ import annotations

import pytest
import torch

from models.mxfp4 import dequantize_mxfp4, quantize_mxfp4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantisation_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)  # every nibble pair
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 10, 128) and ours.dtype == dtype
    # transformers returns [E, in, out] (its expert layout): ours is [E, out, in]
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_each_code_and_nibble_order():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)  # one row of one block
    blocks[0, 0, 0] = 0x2F  # even element: code 0xF = -6, odd: code 0x2 = 1.0
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[0, :2].tolist() == [-12.0, 2.0] and not out[0, 2:].any()


def test_quantised_values_survive_a_round_trip():
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(1)) * 4
    values = dequantize_mxfp4(*quantize_mxfp4(x), torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(values), torch.float32), values)
    assert (values - x).abs().max() <= x.abs().amax() / 4  # coarse, but the nearest code


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))
