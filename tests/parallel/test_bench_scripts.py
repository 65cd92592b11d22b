"""The EP benchmark scripts kept runnable: benchmarks/bench_moe_layer_ep.py's core at EP=4 on gloo
(tiny DeepSeek-V3-like layer, output checked against all experts on one rank) and the
DeepSeek-V3 shape / layouts of benchmarks/bench_parallel_decode.py (no engine started)."""
from __future__ import annotations

from benchmarks.bench_moe_layer_ep import PHASES, format_table, parse_args, run_layer_bench
from tests.all2all.a2a_harness import run_ranks

TOKENS = (1, 8)
BACKENDS = ("allgather_reducescatter", "all_to_all")


def _layer_worker(rank: int, world_size: int):
    import torch
    return run_layer_bench(tokens=TOKENS, hidden=32, num_experts=16, top_k=4, moe_inter=16, n_group=4,
                           topk_group=2, shared_experts=1, dtype=torch.float32, backends=BACKENDS,
                           kernel_backend="torch", iters=2, warmup=1, check=True, device="cpu")


def test_layer_bench_core_at_ep4_on_gloo():
    per_rank = run_ranks(_layer_worker, 4, timeout_s=60.0, collective_timeout_s=20.0)
    rows = per_rank[0]
    assert [(r["tokens_per_rank"], r["backend"]) for r in rows] == [(t, b) for b in BACKENDS for t in TOKENS]
    for r in rows:
        assert r["rel_err"] < 1e-5 and r["max_abs_err"] < 1e-4, r  # EP output == all experts on one rank
        assert r["total_us"] > 0 and all(r[f"{p}_us"] >= 0 for p in PHASES)
        # n_group 4 == EP 4 and linear placement: a group is one rank, 2 groups kept per token.
        assert 1.0 <= r["ranks_per_token"] <= 2.0
    ag = [r for r in rows if r["backend"] == "allgather_reducescatter"]
    assert [r["rows_recv_max"] for r in ag] == [4 * t for t in TOKENS]  # every token on every rank
    # Maxima over ranks: every rank reports the same numbers.
    assert all(r == rows for r in per_rank[1:])
    assert len(format_table(rows).splitlines()) == 2 + len(rows)


def test_layer_bench_cli_defaults_are_deepseek_v3():
    a = parse_args([])
    assert (a.hidden, a.num_experts, a.top_k, a.moe_inter, a.n_group, a.topk_group, a.shared_experts) == \
        (7168, 256, 8, 2048, 8, 4, 1)
    assert a.tokens == [1, 64, 256, 4096] and a.dtype == "bf16" and not a.check
    s = parse_args(["--smoke"])
    assert s.check and s.dtype == "fp32" and s.num_experts % 8 == 0 and s.hidden == 64


def test_parallel_decode_layouts_and_deepseek_shape():
    from benchmarks.bench_parallel_decode import DEEPSEEK_V3, LAYOUTS, SMOKE_DEEPSEEK_V3, layout_kwargs
    from models.deepseek_v3 import DeepseekV3Config

    for name, kw in LAYOUTS.items():  # the original names keep their meaning
        assert layout_kwargs(name) == kw
    assert layout_kwargs("dp8-ep") == dict(data_parallel_size=8, enable_expert_parallel=True)
    assert layout_kwargs("tp4") == dict(tensor_parallel_size=4)
    cfg = DeepseekV3Config.from_hf({**DEEPSEEK_V3, "num_hidden_layers": 8}, "DeepseekV3ForCausalLM")
    assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.n_group, cfg.topk_group, cfg.kv_lora_rank, cfg.q_lora_rank) == (7168, 256, 8, 2048, 8, 4, 512, 1536)
    assert [cfg.is_moe_layer(i) for i in range(8)] == [False] * 3 + [True] * 5
    tiny = DeepseekV3Config.from_hf({**SMOKE_DEEPSEEK_V3, "num_hidden_layers": 2}, "DeepseekV3ForCausalLM")
    assert tiny.n_routed_experts % 8 == 0 and tiny.n_routed_experts // tiny.n_group == 4


def test_parallel_decode_zeroes_the_dummy_router_bias(monkeypatch):
    import torch

    import models.loader as loader
    import moe.worker.worker as worker
    from benchmarks.bench_parallel_decode import zero_router_bias_on_dummy_init

    monkeypatch.setattr(loader, "init_dummy_weights", loader.init_dummy_weights)  # restored after
    monkeypatch.setattr(worker, "init_dummy_weights", worker.init_dummy_weights)
    zero_router_bias_on_dummy_init()
    zero_router_bias_on_dummy_init()  # idempotent
    m = torch.nn.Module()
    m.gate = torch.nn.Module()
    m.gate.e_score_correction_bias = torch.nn.Parameter(torch.ones(8))
    m.gate.weight = torch.nn.Parameter(torch.ones(8, 4))
    worker.init_dummy_weights(m)
    assert torch.equal(m.gate.e_score_correction_bias.data, torch.zeros(8))
    assert m.gate.weight.abs().max() <= 1e-3 and m.gate.weight.abs().max() > 0  # the dummy init itself ran
