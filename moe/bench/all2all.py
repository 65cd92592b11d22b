"""Dispatch + combine latency of the all2all dispatchers against a bare all_to_all_single.

Legend: T tokens per rank, D hidden, E experts, K top-k, S rows sent, R rows received, P ranks.

    torchrun --nproc-per-node=2 -m moe.bench.all2all --out a2a.json   # NCCL, GPU: DeepSeek-V3 shapes
    torchrun --nproc-per-node=2 -m moe.bench.all2all                  # gloo, CPU: small shapes

Defaults depend on the device: on GPUs the DeepSeek-V3 shapes (hidden 7168, 256 experts, top-8,
bf16, 128..16384 tokens per rank); on the CPU small ones (hidden 64, 16 experts, top-4, fp32,
8 and 32 tokens) that finish in seconds. Every flag overrides its default.

For each tokens-per-rank and routing, times (median over iterations, then the max over ranks,
as the slowest rank gates the layer) of dispatch + combine for each dispatcher, the experts
replaced by the identity so only communication and its bookkeeping are measured, and of
"bare": two all_to_all_single calls (there and back) moving exactly the x bytes of the
all_to_all dispatcher's splits into preallocated buffers, the floor of the exchange.
Routing: "random" (uniform top-K of E) and "group_limited" (DeepSeek-V3-like:
E split into n_group groups, the best topk_group groups by the sum of their top-2 scores, then
top-K inside them; with linear placement and n_group == P each group is one rank's experts).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from all2all import LowLatencyDispatcher, make_dispatcher
from all2all.phases import PhaseTimer, median_phases
from moe.bench.common import torchrun_process_group

# (GPU, CPU) defaults of the shape flags
DEFAULTS = {"tokens": ([128, 512, 2048, 4096, 16384], [8, 32]), "hidden": (7168, 64), "num_experts": (256, 16),
            "top_k": (8, 4), "dtype": ("bf16", "fp32"), "n_group": (8, 4), "topk_group": (4, 2), "iters": (20, 5)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_routing(kind: str, T: int, E: int, K: int, n_group: int, topk_group: int,
                 g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights_TK float32, topk_ids_TK int64 global ids), drawn on the CPU then moved."""
    scores_TE = torch.rand(T, E, generator=g)
    if kind == "group_limited":
        grouped_TGX = scores_TE.view(T, n_group, E // n_group)
        group_score_TG = grouped_TGX.topk(min(2, E // n_group), dim=2).values.sum(dim=2)
        keep_TG = torch.zeros(T, n_group, dtype=torch.bool)
        keep_TG.scatter_(1, group_score_TG.topk(topk_group, dim=1).indices, True)
        scores_TE = grouped_TGX.masked_fill(~keep_TG[:, :, None], -1.0).view(T, E)
    elif kind != "random":
        raise ValueError(f"unknown routing {kind!r}; choose 'random' or 'group_limited'")
    weights_TK, ids_TK = scores_TE.topk(K, dim=1)
    return weights_TK.softmax(dim=1).to(device), ids_TK.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_together(device: torch.device, group) -> None:
    """Release all ranks at once, nothing queued: drain this GPU, then a barrier whose completion
    this host waits for (NCCL's barrier is an all-reduce; the explicit sync after it makes the
    wait independent of whether barrier() blocks the host in this torch version)."""
    _sync(device)
    dist.barrier(group=group)
    _sync(device)


def _median_us(step, iters: int, warmup: int, device: torch.device, group) -> tuple[float, float]:
    """(median wall µs of step + GPU drain, median µs until step() returned on the host).
    host ~ wall means the step is bound by host-side launch/dispatch overhead."""
    times, host = [], []
    for i in range(warmup + iters):
        _start_together(device, group)  # not timed
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            host.append(t1 - t0)
    return statistics.median(times) * 1e6, statistics.median(host) * 1e6


def _max_over_ranks(value: float, device: torch.device, group) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def run_bench(tokens=(8, 32), hidden: int = 64, num_experts: int = 16, top_k: int = 4,
              dtype: torch.dtype = torch.float32, routings=("random",),
              backends=("allgather_reducescatter", "all_to_all"), placement: str = "linear",
              n_group: int = 8, topk_group: int = 4, iters: int = 5, warmup: int = 2,
              seed: int = 0, group=None, device=None, progress: bool = False,
              cuda_graphs: bool = False, phases: bool = False) -> list[dict]:
    """The benchmark on an initialised process group; every rank calls it, every rank gets rows.

    Returns one dict per (tokens_per_rank, routing, impl): impl in `backends` + ["bare"],
    median_us (max over ranks), rows_sent / rows_recv of this rank for the all_to_all splits.
    cuda_graphs: also "<impl>+graph" rows, dispatch + combine captured in a CUDA graph and
    replayed (what a decode step under graphs pays: no host launches), for the fixed-capacity
    dispatchers within their capacity and for the bare collectives.
    phases: each dispatcher row also gets "phases", {phase: {host_us, device_us}} (medians over
    `iters` more steps, max over ranks; all2all/phases.py names the phases).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cuda_graphs and device.type != "cuda":
        raise ValueError("cuda_graphs needs a CUDA device (NCCL collectives captured in a graph)")
    rank = dist.get_rank(group)
    fixed = {b: make_dispatcher(b, group, num_experts, placement, top_k=top_k) for b in backends if b != "low_latency"}
    a2a = fixed.get("all_to_all") or make_dispatcher("all_to_all", group, num_experts, placement)
    rows = []
    for T in tokens:
        dispatchers = {b: fixed[b] if b in fixed else _low_latency(group, num_experts, placement, T)
                       for b in backends}
        for routing in routings:
            g = torch.Generator().manual_seed(seed * 1000003 + rank)
            weights_TK, ids_TK = make_routing(routing, T, num_experts, top_k, n_group, topk_group, g, device)
            x_TD = torch.randn(T, hidden, generator=g).to(device=device, dtype=dtype)
            for name, disp in dispatchers.items():
                recv = _dispatch(disp, x_TD, weights_TK, ids_TK)
                y_RD = recv.x_RD.contiguous()  # identity experts; same R every iteration

                def step(disp=disp, y_RD=y_RD):
                    disp.combine(y_RD, _dispatch(disp, x_TD, weights_TK, ids_TK))
                us, host = _median_us(step, iters, warmup, device, group)
                rows.append({"tokens_per_rank": T, "routing": routing, "impl": name,
                             "median_us": _max_over_ranks(us, device, group),
                             "host_us": _max_over_ranks(host, device, group)})
                if phases:
                    rows[-1]["phases"] = _phase_times(disp, step, iters, device, group)
                if cuda_graphs and isinstance(disp, LowLatencyDispatcher) and T <= disp.capacity:
                    rows.append(_graph_row(step, T, routing, name, iters, warmup, device, group))
            h = a2a.dispatch(x_TD, weights_TK, ids_TK)._handle
            send_SD = torch.randn(sum(h.send_splits), hidden, generator=g).to(device=device, dtype=dtype)
            recv_RD = torch.empty(sum(h.recv_splits), hidden, dtype=dtype, device=device)
            back_SD = torch.empty_like(send_SD)

            def bare(h=h, send_SD=send_SD, recv_RD=recv_RD, back_SD=back_SD):
                dist.all_to_all_single(recv_RD, send_SD, h.recv_splits, h.send_splits, group=group)
                dist.all_to_all_single(back_SD, recv_RD, h.send_splits, h.recv_splits, group=group)
            us, host = _median_us(bare, iters, warmup, device, group)
            rows.append({"tokens_per_rank": T, "routing": routing, "impl": "bare",
                         "median_us": _max_over_ranks(us, device, group),
                         "host_us": _max_over_ranks(host, device, group)})
            if cuda_graphs:
                rows.append(_graph_row(bare, T, routing, "bare", iters, warmup, device, group))
            for row in rows:
                if (row["tokens_per_rank"], row["routing"]) == (T, routing):
                    row.update(rows_sent=sum(h.send_splits), rows_recv=sum(h.recv_splits))
            if progress and rank == 0:
                print(f"  tokens/rank {T}, {routing}: done", flush=True)
    return rows


def _phase_times(disp, step, iters: int, device, group) -> dict:
    """{phase: {host_us, device_us}} of `step` (dispatch + combine on `disp`): medians over iters
    steps, each started together, then the max over ranks (every rank marks the same phases)."""
    timer = PhaseTimer(device)
    disp.phase_timer = timer
    runs = []
    try:
        for _ in range(iters):
            _start_together(device, group)
            timer.start()
            step()
            runs.append(timer.phases())
    finally:
        disp.phase_timer = None
    out = {}
    for name, t in median_phases(runs).items():
        out[name] = {"host_us": _max_over_ranks(t["host_us"], device, group),
                     "device_us": None if t["device_us"] is None else _max_over_ranks(t["device_us"], device, group)}
    return out


def format_phases(rows: list[dict]) -> str:
    """One line per timed (size, routing, impl): each phase's host / device µs."""
    lines = []
    for r in rows:
        if "phases" not in r:
            continue
        cells = [f"{n} {t['host_us']:.0f}/{'-' if t['device_us'] is None else format(t['device_us'], '.0f')}"
                 for n, t in r["phases"].items()]
        lines.append(f"{r['tokens_per_rank']} {r['routing']} {r['impl']}: " + ", ".join(cells))
    return "\n".join(["phases, host/device µs:", *lines]) if lines else ""


def _graph_row(step, T: int, routing: str, name: str, iters: int, warmup: int, device, group) -> dict:
    """`step` captured once in a CUDA graph (every rank at once: the collectives are captured
    too), then timed as replays."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # the first calls of a stream allocate outside the capture
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    _start_together(device, group)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    us, host = _median_us(graph.replay, iters, warmup, device, group)
    return {"tokens_per_rank": T, "routing": routing, "impl": f"{name}+graph",
            "median_us": _max_over_ranks(us, device, group), "host_us": _max_over_ranks(host, device, group)}


def _dispatch(disp, x_TD, weights_TK, ids_TK):
    """A dispatch as the engine calls it: a fixed-capacity dispatcher (also "auto" on CUDA) is told
    the most tokens any rank holds (every rank holds T here), so calls over its capacity fall back."""
    if isinstance(disp, LowLatencyDispatcher):
        return disp.dispatch(x_TD, weights_TK, ids_TK, max_tokens_across_ranks=len(x_TD))
    return disp.dispatch(x_TD, weights_TK, ids_TK)


def _low_latency(group, num_experts: int, placement: str, tokens_per_rank: int):
    """The fixed-capacity dispatcher sized to the call (capacity = tokens per rank, at least 1), as
    the engine sizes it to its decode batch."""
    return make_dispatcher("low_latency", group, num_experts, placement, capacity=max(tokens_per_rank, 1))


def _bench_steps(T: int, routing: str, hidden: int, num_experts: int, top_k: int, dtype,
                 backends, placement: str, n_group: int, topk_group: int, seed: int, group, device):
    """(name, step) for each backend and "bare" at one size, inputs made and warmed once."""
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    weights_TK, ids_TK = make_routing(routing, T, num_experts, top_k, n_group, topk_group, g, device)
    x_TD = torch.randn(T, hidden, generator=g).to(device=device, dtype=dtype)
    steps = []
    for b in backends:
        disp = _low_latency(group, num_experts, placement, T) if b == "low_latency" else \
            make_dispatcher(b, group, num_experts, placement, top_k=top_k)
        y_RD = _dispatch(disp, x_TD, weights_TK, ids_TK).x_RD.contiguous()  # identity experts

        def step(disp=disp, y_RD=y_RD):
            disp.combine(y_RD, _dispatch(disp, x_TD, weights_TK, ids_TK))
        steps.append((b, step))
    a2a = make_dispatcher("all_to_all", group, num_experts, placement)
    h = a2a.dispatch(x_TD, weights_TK, ids_TK)._handle
    send_SD = torch.randn(sum(h.send_splits), hidden, generator=g).to(device=device, dtype=dtype)
    recv_RD = torch.empty(sum(h.recv_splits), hidden, dtype=dtype, device=device)
    back_SD = torch.empty_like(send_SD)

    def bare():
        dist.all_to_all_single(recv_RD, send_SD, h.recv_splits, h.send_splits, group=group)
        dist.all_to_all_single(back_SD, recv_RD, h.send_splits, h.recv_splits, group=group)
    steps.append(("bare", bare))
    return steps


def _evt_us(evt, attr: str) -> float:
    # torch renamed *_cuda_time_total to *_device_time_total; accept both.
    for name in (f"self_device_{attr}", f"self_cuda_{attr}"):
        if hasattr(evt, name):
            return float(getattr(evt, name))
    return 0.0


def profile_bench(tokens, hidden: int, num_experts: int, top_k: int, dtype, routing: str,
                  backends, placement: str, n_group: int, topk_group: int, iters: int, seed: int,
                  group=None, device=None, top: int = 10) -> tuple[list[dict], str]:
    """torch.profiler over `iters` steps per (tokens, impl), after 3 warm-up steps.

    Returns (summary rows, full text report). Per row: wall µs per step on this rank, kernel
    (device) µs per step, kernel launches, NCCL calls, host syncs and host->device copies per
    step, and the top device and CPU ops. Counts come from the CUDA runtime events of the trace.
    """
    from torch.profiler import ProfilerActivity, profile
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    rows, report = [], []
    for T in tokens:
        for name, step in _bench_steps(T, routing, hidden, num_experts, top_k, dtype, backends,
                                       placement, n_group, topk_group, seed, group, device):
            for _ in range(3):
                _start_together(device, group)
                step()
            walls = []
            with profile(activities=acts) as prof:
                for _ in range(iters):
                    _start_together(device, group)
                    t0 = time.perf_counter()
                    step()
                    _sync(device)
                    walls.append(time.perf_counter() - t0)
            ka = prof.key_averages()
            dev_evts = [e for e in ka if _evt_us(e, "time_total") > 0 and e.key != "ProfilerStep*"
                        and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
            cnt = {e.key: e.count for e in ka}

            def count(*names):
                return sum(cnt.get(n, 0) for n in names) / iters
            row = {"tokens_per_rank": T, "impl": name,
                   "wall_us_profiled": statistics.median(walls) * 1e6,
                   "kernel_us": sum(_evt_us(e, "time_total") for e in dev_evts) / iters,
                   "launches": count("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                     "cudaLaunchKernelExC"),
                   "collectives": sum(c for k, c in cnt.items() if k.startswith("c10d::")
                                      and k != "c10d::barrier") / iters,
                   # raw counts include _start_together's and the timing's: compare with "bare",
                   # whose step has none
                   "syncs_raw": count("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                      "cudaEventSynchronize"),
                   "memcpy": count("cudaMemcpyAsync", "cudaMemcpy"),
                   "top_device": [(e.key[:60], round(_evt_us(e, "time_total") / iters, 1))
                                  for e in sorted(dev_evts, key=lambda e: -_evt_us(e, "time_total"))[:5]]}
            rows.append(row)
            report.append(f"===== T={T} impl={name} routing={routing}: {row}")
            for sort in ("self_device_time_total" if hasattr(ka[0], "self_device_time_total")
                         else "self_cuda_time_total", "self_cpu_time_total"):
                report.append(ka.table(sort_by=sort, row_limit=top, max_name_column_width=60))
    return rows, "\n".join(report)


def format_table(rows: list[dict]) -> str:
    """Markdown table; each impl against the bare collectives run the same way (eager, or
    replayed from a CUDA graph for "+graph" rows). A size without an impl's row shows "-"."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    ratios = [i for i in impls if not i.startswith("bare")]
    head = ["tokens/rank", "routing", *[f"{i} µs" for i in impls], *[f"{i}/bare" for i in ratios]]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    keys = list(dict.fromkeys((r["tokens_per_rank"], r["routing"]) for r in rows))
    for key in keys:
        by_impl = {r["impl"]: r["median_us"] for r in rows if (r["tokens_per_rank"], r["routing"]) == key}
        cells = [str(key[0]), key[1], *[f"{by_impl[i]:.1f}" if i in by_impl else "-" for i in impls]]
        for i in ratios:
            bare = by_impl.get("bare+graph" if i.endswith("+graph") else "bare")
            cells.append(f"{by_impl[i] / bare:.2f}" if i in by_impl and bare else "-")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def parse_args(argv=None, cuda: bool | None = None) -> argparse.Namespace:
    """Flags; shape flags left out take the GPU or CPU default (`cuda`: default torch.cuda.is_available())."""
    p = argparse.ArgumentParser(prog="moe bench all2all", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", help="tokens per rank")
    p.add_argument("--hidden", type=int)
    p.add_argument("--num-experts", type=int)
    p.add_argument("--top-k", type=int)
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--routing", nargs="+", choices=["random", "group_limited"], default=["random", "group_limited"])
    p.add_argument("--backends", nargs="+", default=["allgather_reducescatter", "all_to_all"],
                   choices=["allgather_reducescatter", "all_to_all", "auto", "low_latency"],
                   help="low_latency runs with capacity = tokens per rank; auto as the engine builds it (on "
                        "CUDA: low_latency of capacity 256, falling back by the bytes rule above it)")
    p.add_argument("--placement", choices=["linear", "round_robin"], default="linear")
    p.add_argument("--n-group", type=int, help="expert groups of group_limited routing")
    p.add_argument("--topk-group", type=int, help="groups kept per token (group_limited)")
    p.add_argument("--iters", type=int)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the raw rows and the configuration as JSON here (rank 0)")
    p.add_argument("--phases", action="store_true",
                   help="also time each phase of dispatch + combine (host and GPU µs; --iters more steps per row)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time low_latency (and auto where it is low_latency) within its capacity and the "
                        "bare collectives replayed from a CUDA graph: '<impl>+graph' rows")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: torch.profiler over --iters steps per backend and size "
                        "(first --routing only); prints a summary, full tables to --profile-out")
    p.add_argument("--profile-out", help="full profiler tables (rank 0), default: stdout")
    args = p.parse_args(argv)
    which = 0 if (torch.cuda.is_available() if cuda is None else cuda) else 1
    for name, values in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, values[which])
    return args


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def main(argv=None) -> int:
    """CLI entry (`moe bench all2all`); run under torchrun, one process per device."""
    args = parse_args(argv)
    if not under_torchrun():
        print("moe bench all2all: run it under torchrun, one process per device, e.g.\n"
              "    torchrun --nproc-per-node=2 -m moe.bench.all2all " + " ".join(argv or sys.argv[1:]),
              file=sys.stderr)
        return 2
    with torchrun_process_group() as device:
        if args.profile:
            rows, report = profile_bench(args.tokens, args.hidden, args.num_experts, args.top_k,
                                         DTYPES[args.dtype], args.routing[0], args.backends,
                                         args.placement, args.n_group, args.topk_group, args.iters,
                                         args.seed, device=device)
            if dist.get_rank() == 0:
                import all2all
                print(f"profile of {os.path.dirname(all2all.__file__)}")
                for r in rows:
                    print(json.dumps(r))
                if args.profile_out:
                    os.makedirs(os.path.dirname(os.path.abspath(args.profile_out)), exist_ok=True)
                    with open(args.profile_out, "w") as f:
                        f.write(report)
                else:
                    print(report)
            return 0
        rows = run_bench(args.tokens, args.hidden, args.num_experts, args.top_k, DTYPES[args.dtype],
                         args.routing, args.backends, args.placement, args.n_group, args.topk_group,
                         args.iters, args.warmup, args.seed, device=device, progress=True,
                         cuda_graphs=args.cuda_graphs, phases=args.phases)
        if dist.get_rank() == 0:
            cfg = {k: v for k, v in vars(args).items() if k != "out"}
            cfg.update(world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       torch=torch.__version__)
            print(f"all2all bench: {cfg}")
            print(format_table(rows))
            if args.phases:
                print(format_phases(rows))
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump({"config": cfg, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
