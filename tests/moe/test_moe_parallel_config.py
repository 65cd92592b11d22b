"""The MoE block's parallel layout is a typed config given at construction: it decides the
expert shards, and the engine's moe_backend reaches every block through it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from models.layers.moe import FusedMoE, MoEParallelConfig
from models.parallel.state import ParallelState
from models.tiny import TINY_QWEN3_MOE_CONFIG
from moe.config import EngineArgs
from routing import RouterOutput


def test_from_parallel_state_copies_the_layout():
    group = object()
    ps = ParallelState(tp_size=2, tp_rank=1, ep_size=4, ep_rank=3, ep_group=group, enable_expert_parallel=True,
                       all2all_backend="all_to_all", expert_placement_strategy="round_robin")
    pc = MoEParallelConfig.from_parallel_state(kernel_backend="torch", state=ps)
    assert (pc.tp_size, pc.tp_rank, pc.ep_size, pc.ep_rank, pc.use_ep) == (2, 1, 4, 3, True)
    assert (pc.all2all_backend, pc.expert_placement_strategy, pc.kernel_backend) == ("all_to_all", "round_robin",
                                                                                      "torch")
    assert pc.ep_group is group
    no_ep = MoEParallelConfig.from_parallel_state(state=dataclasses.replace(ps, enable_expert_parallel=False))
    assert not no_ep.use_ep and no_ep.ep_group is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        pc.tp_size = 1


def test_the_config_decides_the_expert_shards():
    E, D, F = 8, 16, 12
    tp = FusedMoE(E, D, F, MoEParallelConfig(tp_size=2, tp_rank=1))
    assert tp.w13_weight.shape == (E, 2 * F // 2, D) and tp.w2_weight.shape == (E, D, F // 2) and tp.reduce_over_tp
    ep = FusedMoE(E, D, F, MoEParallelConfig(ep_size=4, ep_rank=1, use_ep=True))
    assert ep.w13_weight.shape == (E // 4, 2 * F, D) and not ep.reduce_over_tp
    assert ep.w13_weight.param_loader.local_ids == [2, 3]  # linear placement: rank 1 of 4 holds experts 2, 3
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=5"):
        FusedMoE(E, D, F, MoEParallelConfig(tp_size=5))


def test_kernel_backend_reaches_the_expert_call(monkeypatch):
    seen = []

    def spy(x, w13, w2, weights, ids, expert_map=None, backend=None, **kw):
        seen.append(backend)
        return torch.zeros_like(x)
    monkeypatch.setattr(kernels, "fused_experts", spy)
    layer = FusedMoE(4, 8, 6, MoEParallelConfig(kernel_backend="torch"))
    layer(torch.randn(3, 8), RouterOutput(torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.int32)))
    assert seen == ["torch"]


def test_build_model_gives_every_block_the_engine_backend(tmp_path, monkeypatch):
    from models.registry import resolve_architecture
    from moe.worker.worker import build_model

    cfg = dict(TINY_QWEN3_MOE_CONFIG, num_hidden_layers=2)
    model_cls = resolve_architecture(cfg)
    config = model_cls.config_class.from_hf(cfg, cfg["architectures"][0])
    args = EngineArgs(model=str(tmp_path), load_format="dummy", moe_backend="torch", device="cpu")
    model = build_model(model_cls, config, str(tmp_path), args, torch.device("cpu"), torch.float32)
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == 2
    assert all(b.kernel_backend == "torch" and b.parallel is blocks[0].parallel for b in blocks)
