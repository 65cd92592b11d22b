"""The Llama-4 vision tower's 2-D RoPE through the interleaved Triton rotary kernel (its GPU path)
gives the bits of the torch reference `apply_pair_rotation` (under TRITON_INTERPRET on the CPU)."""
from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from models.llama4_vision import Llama4VisionConfig, VisionAttention, apply_pair_rotation, \
    vision_rope_angles  # noqa: E402

from tests.kernels.triton_marks import CUDA, needs_triton_device  # noqa: E402


@needs_triton_device
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_vision_rope_equals_the_reference(dtype):
    dev = "cuda" if CUDA else "cpu"
    cfg = Llama4VisionConfig(hidden_size=48, intermediate_size=192, num_attention_heads=2, image_size=56,
                             patch_size=14, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48)
    attn = VisionAttention(cfg, split=False)
    H, d, S, N = attn.num_heads, attn.head_dim, cfg.grid_size ** 2 + 1, 3  # 16 patches + CLS, 3 tiles
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(N, S, H * d, generator=gen).to(dev, dtype) for _ in range(2))
    angles = vision_rope_angles(cfg.grid_size, d, cfg.rope_theta, device=dev)
    cos, sin = angles.cos(), angles.sin()
    got_q, got_k = attn._rotate_triton(q, k, cos, sin)

    def reference(t):
        return apply_pair_rotation(t.unflatten(-1, (H, d)).transpose(1, 2), cos, sin)
    assert got_q.shape == (N, H, S, d)
    assert torch.equal(got_q, reference(q)) and torch.equal(got_k, reference(k))
