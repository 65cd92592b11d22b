"""EPLB's weight moves between two gloo ranks (models/layers/expert_replicas.py): FP8 weights with their fp32
scales and bf16 weights land in the right slots, local copies included, and a slot whose expert
stays is not touched."""
from __future__ import annotations

import torch

from models.layers.expert_replicas import move_expert_weights, plan_moves
from tests.all2all.a2a_harness import run_ranks

S, E = 3, 4  # 2 ranks x 3 slots: 4 experts + 2 redundant


def _expert_tensors(e: int) -> list[torch.Tensor]:
    """Per-slot tensors of logical expert e: distinct values per expert and per kind."""
    g = torch.Generator().manual_seed(100 + e)
    w13 = (torch.randn(6, 5, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=g) + e
    w2 = torch.randn(5, 4, generator=g).to(torch.bfloat16)
    return [w13, scale, w2]


def _slots_of(placement: list[int], rank: int) -> list[torch.Tensor]:
    per_slot = [_expert_tensors(e) for e in placement[rank * S:(rank + 1) * S]]
    return [torch.stack([slot[i] for slot in per_slot]) for i in range(3)]


def _move(rank: int, world: int, old: list[int], new: list[int]):
    params = _slots_of(old, rank)
    received = move_expert_weights(params, old, new, rank, S, None)
    want = _slots_of(new, rank)
    same = all(torch.equal(p.view(torch.uint8), w.view(torch.uint8)) for p, w in zip(params, want))
    return received, same


def test_fp8_weights_and_scales_move_to_their_new_slots():
    old = [0, 1, 2, 3, 0, 1]
    new = [0, 3, 0, 3, 2, 1]  # rank 0: slot 1 gets 3 (from rank 1), slot 2 a local copy of 0; rank 1: slot 4 gets 2
    results = run_ranks(_move, 2, args=(old, new))
    assert results == [(2, True), (1, True)]
    assert plan_moves(old, new, S) == [(3, 1), (0, 2), (2, 4)]
