"""Smoke test of moe/bench/all2all.py (`moe bench all2all`): its core on 2 gloo ranks at tiny sizes, no torchrun."""
from __future__ import annotations

from tests.all2all.a2a_harness import run_ranks
from moe.bench.all2all import format_phases, format_table, main, parse_args, run_bench

TOKENS = (0, 3, 16)


def _bench_worker(rank: int, world_size: int):
    import torch
    return run_bench(tokens=TOKENS, hidden=32, num_experts=16, top_k=4, dtype=torch.bfloat16,
                     routings=("random", "group_limited"),
                     backends=("allgather_reducescatter", "all_to_all", "auto", "low_latency"),
                     iters=2, warmup=1, device="cpu")


def test_bench_core_on_two_gloo_ranks():
    per_rank = run_ranks(_bench_worker, 2, timeout_s=40.0, collective_timeout_s=15.0)
    rows = per_rank[0]
    impls = ["allgather_reducescatter", "all_to_all", "auto", "low_latency", "bare"]
    assert [(r["tokens_per_rank"], r["routing"], r["impl"]) for r in rows] == [
        (t, routing, impl) for t in TOKENS for routing in ("random", "group_limited") for impl in impls]
    assert all(r["median_us"] > 0 for r in rows)
    # Timings are maxima over ranks, so both ranks report the same numbers.
    assert [r["median_us"] for r in rows] == [r["median_us"] for r in per_rank[1]]
    table = format_table(rows)
    assert "all_to_all/bare" in table and len(table.splitlines()) == 2 + 2 * len(TOKENS)


def test_cli_defaults_are_deepseek_v3_shapes_on_gpus_and_small_on_the_cpu():
    args = parse_args([], cuda=True)
    assert args.tokens == [128, 512, 2048, 4096, 16384]
    assert (args.hidden, args.num_experts, args.top_k, args.dtype) == (7168, 256, 8, "bf16")
    args = parse_args([], cuda=False)
    assert args.tokens == [8, 32] and (args.hidden, args.num_experts, args.top_k, args.dtype) == (64, 16, 4, "fp32")
    args = parse_args(["--hidden", "128", "--tokens", "4"], cuda=False)  # a flag given wins
    assert args.hidden == 128 and args.tokens == [4]


def test_without_torchrun_says_to_use_torchrun(monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    assert main(["--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node=2 -m moe.bench.all2all --iters 1" in err


def test_graph_rows_compare_with_the_bare_graph_and_need_cuda():
    import pytest
    rows = [{"tokens_per_rank": 128, "routing": "random", "impl": i, "median_us": us}
            for i, us in (("low_latency", 800.0), ("low_latency+graph", 60.0), ("bare", 160.0), ("bare+graph", 40.0))]
    rows.append({"tokens_per_rank": 512, "routing": "random", "impl": "bare", "median_us": 100.0})
    lines = format_table(rows).splitlines()
    assert lines[0].split(" | ")[-2:] == ["low_latency/bare", "low_latency+graph/bare"]
    assert lines[2].split(" | ")[-2:] == ["5.00", "1.50"]  # against bare, and the graph against bare+graph
    assert lines[3].split(" | ")[-2:] == ["-", "-"]  # no row of that size
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        run_bench(tokens=(4,), cuda_graphs=True, device="cpu")


def _phases_worker(rank: int, world_size: int):
    import torch
    return run_bench(tokens=(5, 40), hidden=32, num_experts=16, top_k=4, dtype=torch.float32,
                     backends=("allgather_reducescatter", "all_to_all", "low_latency", "auto"),
                     iters=2, warmup=1, device="cpu", phases=True)


def test_phase_timers_name_every_phase_of_each_backend():
    rows = run_ranks(_phases_worker, 2, timeout_s=40.0, collective_timeout_s=15.0)[0]
    want = {
        "all_to_all": ["count_exchange", "pack", "sync", "transfer", "unpack", "combine_transfer", "combine"],
        "allgather_reducescatter": ["count_exchange", "pack", "sync", "transfer", "unpack", "combine_transfer"],
        "low_latency": ["route", "pack", "transfer", "unpack", "combine_transfer", "combine"],
        "auto": ["count_exchange", "pack", "sync", "transfer", "unpack", "combine_transfer"],  # gloo: AG+RS
    }
    timed = [r for r in rows if "phases" in r]
    assert {(r["tokens_per_rank"], r["impl"]) for r in timed} == {(t, b) for t in (5, 40) for b in want}
    for r in timed:
        assert list(r["phases"]) == want[r["impl"]], (r["impl"], list(r["phases"]))
        assert all(t["host_us"] > 0 and t["device_us"] is None for t in r["phases"].values())
    assert not any("phases" in r for r in rows if r["impl"] == "bare")
    assert "low_latency: route" in format_phases(rows)
