"""One DeepSeek-V3-shaped MoE layer under expert parallelism, end to end per step, with a breakdown.

Legend: T tokens per rank, D hidden, E routed experts, K top-k, F expert intermediate size,
P ranks (= EP size), R rows a rank's experts receive, G expert groups, TG groups kept per token.

    # 8 GPUs (NCCL), the DeepSeek-V3 shape (D 7168, E 256, K 8, F 2048, G 8 / TG 4, 1 shared expert):
    torchrun --nproc-per-node=8 benchmarks/bench_moe_layer_ep.py --out results/moe_layer_ep8.json
    # CPU (gloo), tiny shapes, output checked against all experts on one rank:
    torchrun --nproc-per-node=8 benchmarks/bench_moe_layer_ep.py --smoke

Every rank holds E/P whole experts (linear placement: rank p holds experts [p*E/P, (p+1)*E/P);
with G == P each expert group is one rank's experts, so group-limited routing sends a token to at
most TG ranks), dummy bf16 weights, and its own T random tokens. One step is what
models/layers/moe.py runs per MoE layer:

  router    gate logits (fp32 [E, D] weight) -> routing.grouped_topk (sigmoid, correction bias,
            group-limited, renormalised, x routed_scaling_factor)
  dispatch  dispatcher.dispatch (all2all/: allgather_reducescatter or all_to_all)
  experts   kernels.fused_experts on the received rows with the dispatcher's expert_map
  combine   dispatcher.combine
  shared    the shared expert(s) on the rank's own T tokens (SwiGLU, F * n_shared), added

Times: a barrier and device drain before every step (not timed); GPU: CUDA events on the
current stream at the phase boundaries (the collectives' completion is ordered into that
stream), CPU: perf_counter at the same points. Per phase and in total, the median over
iterations on each rank, then the max over ranks (the slowest rank gates the layer). `wall_us`
is the host-side time from the step start to the drained device, the same as bench_all2all.py's.
Each phase's median is taken separately: the phases need not add up to the total's median.
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
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script by torchrun: make the repo importable
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402
from all2all import make_dispatcher  # noqa: E402
from moe.bench.common import torchrun_process_group  # noqa: E402
from routing.grouped_topk import grouped_topk  # noqa: E402
from routing.placement import expert_owner_ranks, local_expert_ids  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# ||EP - one rank|| / ||one rank||: rounding and summation order only (a lost or doubled expert
# contribution is O(0.1) and more).
CHECK_TOL = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 2e-2}
PHASES = ("router", "dispatch", "experts", "combine", "shared")
DEFAULT_TOKENS = (1, 64, 256, 4096)
# DeepSeek-V3 (hub config.json) MoE layer.
DSV3 = dict(hidden=7168, num_experts=256, top_k=8, moe_inter=2048, n_group=8, topk_group=4,
            shared_experts=1, routed_scaling_factor=2.5)
# --smoke: every dimension tiny, E divisible by 8 ranks, G == 8 as in DeepSeek-V3.
SMOKE = dict(hidden=64, num_experts=32, top_k=4, moe_inter=32, n_group=8, topk_group=4,
             shared_experts=1, routed_scaling_factor=2.5)
SMOKE_TOKENS = (1, 8, 32)


def _gen(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def expert_weights(ids: list[int], D: int, Fi: int, dtype, device, seed: int):
    """(w13 [len(ids), 2F, D], w2 [len(ids), D, F]): expert e's weights depend on (seed, e) only,
    so every rank can rebuild any expert (the --check reference). Scaled so activations stay O(1)."""
    w13 = torch.empty(len(ids), 2 * Fi, D, dtype=dtype, device=device)
    w2 = torch.empty(len(ids), D, Fi, dtype=dtype, device=device)
    for i, e in enumerate(ids):
        g = _gen(seed * 100003 + 7919 * e + 1, device)
        w13[i] = torch.randn(2 * Fi, D, generator=g, device=device, dtype=torch.float32).mul_(D ** -0.5).to(dtype)
        w2[i] = torch.randn(D, Fi, generator=g, device=device, dtype=torch.float32).mul_(Fi ** -0.5).to(dtype)
    return w13, w2


class _Layer:
    """The weights of one layer on one rank and its step, phase by phase."""

    def __init__(self, backend: str, group, hidden: int, num_experts: int, top_k: int, moe_inter: int,
                 n_group: int, topk_group: int, shared_experts: int, routed_scaling_factor: float,
                 dtype, device, seed: int, kernel_backend: str | None):
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        self.D, self.E, self.K, self.F, self.G, self.TG = hidden, num_experts, top_k, moe_inter, n_group, topk_group
        self.scale, self.dtype, self.device, self.kernel_backend = routed_scaling_factor, dtype, device, kernel_backend
        self.seed = seed
        self.disp = make_dispatcher(backend, group, num_experts, "linear", top_k=top_k)
        self.backend = type(self.disp).name  # "auto" resolved
        self.local_ids = local_expert_ids(num_experts, P, rank, "linear")
        self.w13, self.w2 = expert_weights(self.local_ids, hidden, moe_inter, dtype, device, seed)
        self.expert_map = self.disp.expert_map_on(device)
        g = _gen(seed, device)  # replicated: the same gate on every rank
        self.gate_ED = torch.randn(num_experts, hidden, generator=g, device=device).mul_(hidden ** -0.5)
        self.bias_E = torch.randn(num_experts, generator=g, device=device).mul_(0.01)
        self.shared = None
        if shared_experts:
            Fs = moe_inter * shared_experts
            self.shared = (torch.randn(2 * Fs, hidden, generator=g, device=device).mul_(hidden ** -0.5).to(dtype),
                           torch.randn(hidden, Fs, generator=g, device=device).mul_(Fs ** -0.5).to(dtype))

    def route(self, x_TD):
        return grouped_topk(F.linear(x_TD.float(), self.gate_ED), self.K, num_expert_group=self.G,
                            topk_group=self.TG, renormalize=True, routed_scaling_factor=self.scale,
                            e_score_correction_bias_E=self.bias_E, scoring_func="sigmoid")

    def shared_mlp(self, x_TD):
        w13, w2 = self.shared
        gate, up = F.linear(x_TD, w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    def step(self, x_TD, stamp):
        """The layer's forward; stamp() after each phase. Returns (y_TD, rows received)."""
        r = self.route(x_TD)
        stamp()
        recv = self.disp.dispatch(x_TD, r.topk_weights_TK, r.topk_ids_TK)
        stamp()
        y_RD = kernels.fused_experts(recv.x_RD, self.w13, self.w2, recv.topk_weights_RK, recv.topk_ids_RK,
                                     expert_map=self.expert_map, backend=self.kernel_backend)
        stamp()
        y_TD = self.disp.combine(y_RD, recv)
        stamp()
        if self.shared is not None:
            y_TD = y_TD + self.shared_mlp(x_TD)
        stamp()
        return y_TD, recv.num_rows

    def reference(self, x_TD):
        """The same layer on this rank alone with all E experts (no dispatch), for --check."""
        r = self.route(x_TD)
        w13, w2 = expert_weights(list(range(self.E)), self.D, self.F, self.dtype, self.device, self.seed)
        y = kernels.fused_experts(x_TD, w13, w2, r.topk_weights_TK, r.topk_ids_TK, backend=self.kernel_backend)
        return y + self.shared_mlp(x_TD) if self.shared is not None else y


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _start_together(device, group) -> None:
    _sync(device)
    dist.barrier(group=group)
    _sync(device)


def _max_over_ranks(values: list[float], device, group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _sum_over_ranks(values: list[float], device, group) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def _time_steps(layer: _Layer, x_TD, iters: int, warmup: int, group):
    """Per iteration: [router, dispatch, experts, combine, shared] µs, total µs, wall µs."""
    dev = x_TD.device
    samples = []
    rows = 0
    for i in range(warmup + iters):
        _start_together(dev, group)
        if dev.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
            it = iter(marks)

            def stamp(it=it):
                next(it).record()
        else:
            marks = []

            def stamp(marks=marks):
                marks.append(time.perf_counter())
        t0 = time.perf_counter()
        stamp()
        _, rows = layer.step(x_TD, stamp)
        _sync(dev)
        wall = (time.perf_counter() - t0) * 1e6
        if i < warmup:
            continue
        if dev.type == "cuda":
            phases = [a.elapsed_time(b) * 1e3 for a, b in zip(marks, marks[1:])]
        else:
            phases = [(b - a) * 1e6 for a, b in zip(marks, marks[1:])]
        samples.append((phases, sum(phases), wall))
    med_phases = [statistics.median(s[0][j] for s in samples) for j in range(len(PHASES))]
    return med_phases, statistics.median(s[1] for s in samples), statistics.median(s[2] for s in samples), rows


def run_layer_bench(tokens=SMOKE_TOKENS, hidden: int = 64, num_experts: int = 32, top_k: int = 4,
                    moe_inter: int = 32, n_group: int = 8, topk_group: int = 4, shared_experts: int = 1,
                    routed_scaling_factor: float = 2.5, dtype: torch.dtype = torch.float32,
                    backends=("allgather_reducescatter", "all_to_all"), kernel_backend: str | None = None,
                    iters: int = 5, warmup: int = 2, seed: int = 0, check: bool = False,
                    group=None, device=None) -> list[dict]:
    """The benchmark on an initialised process group; every rank calls it, every rank gets the rows.

    One dict per (tokens_per_rank, backend): total_us, wall_us and <phase>_us for each of PHASES
    (median over iterations, then max over ranks), rows_recv_max (R of the busiest rank),
    ranks_per_token (mean over all tokens of the distinct ranks a token's experts are on) and,
    with check, max_abs_err and rel_err (L2) against all experts on one rank (max over ranks).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    P, rank = dist.get_world_size(group), dist.get_rank(group)
    owner_E = expert_owner_ranks(num_experts, P, "linear").to(device).long()
    rows = []
    for backend in backends:
        layer = _Layer(backend, group, hidden, num_experts, top_k, moe_inter, n_group, topk_group,
                       shared_experts, routed_scaling_factor, dtype, device, seed, kernel_backend)
        for T in tokens:
            g = _gen(seed * 1000003 + 17 * rank + T, device)
            x_TD = torch.randn(T, hidden, generator=g, device=device).to(dtype)
            phases, total, wall, R = _time_steps(layer, x_TD, iters, warmup, group)
            ids_TK = layer.route(x_TD).topk_ids_TK.long()
            dest_TK = owner_E[ids_TK]
            distinct = sum(int((dest_TK == p).any(dim=1).sum()) for p in range(P))
            row = {"tokens_per_rank": T, "backend": layer.backend}
            vals = _max_over_ranks([total, wall, *phases, float(R)], device, group)
            row.update(total_us=vals[0], wall_us=vals[1], **{f"{p}_us": v for p, v in zip(PHASES, vals[2:])})
            row["rows_recv_max"] = int(vals[-1])
            n_tok, n_dist = _sum_over_ranks([float(T), float(distinct)], device, group)
            row["ranks_per_token"] = n_dist / n_tok if n_tok else 0.0
            if check:
                y, _ = layer.step(x_TD, lambda: None)
                ref = layer.reference(x_TD).float()
                diff = y.float() - ref
                err = [float(diff.abs().max()), float(diff.norm() / ref.norm().clamp_min(1e-30))] if T else [0.0, 0.0]
                row["max_abs_err"], row["rel_err"] = _max_over_ranks(err, device, group)
                del y, ref, diff
            rows.append(row)
            del x_TD
        del layer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict]) -> str:
    head = ["tokens/rank", "backend", "total µs", *[f"{p} µs" for p in PHASES], "wall µs", "R max", "ranks/token"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join([str(r["tokens_per_rank"]), r["backend"], f"{r['total_us']:.1f}",
                                 *[f"{r[p + '_us']:.1f}" for p in PHASES], f"{r['wall_us']:.1f}",
                                 str(r["rows_recv_max"]), f"{r['ranks_per_token']:.2f}"]))
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_moe_layer_ep", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=None, help=f"tokens per rank (default {DEFAULT_TOKENS})")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--moe-inter", type=int, default=None, help="expert intermediate size F")
    p.add_argument("--n-group", type=int, default=None)
    p.add_argument("--topk-group", type=int, default=None)
    p.add_argument("--shared-experts", type=int, default=None, help="0 = none")
    p.add_argument("--routed-scaling-factor", type=float, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bf16 (fp32 with --smoke)")
    p.add_argument("--backends", nargs="+", default=["allgather_reducescatter", "all_to_all"],
                   choices=["allgather_reducescatter", "all_to_all", "auto"])
    p.add_argument("--kernel-backend", choices=["torch", "triton"], default=None,
                   help="kernels.fused_experts backend (default: the best for the device)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 30, smoke 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5, smoke 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="after timing, compare each size's output with all E experts on one rank (builds all "
                        "E experts on every rank: 22.5 GB at the DeepSeek-V3 shape; on with --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (D 64, E 32, K 4, F 32), fp32, checked")
    p.add_argument("--out", help="write the configuration and rows as JSON here (rank 0)")
    args = p.parse_args(argv)
    shape = SMOKE if args.smoke else DSV3
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.tokens = args.tokens or list(SMOKE_TOKENS if args.smoke else DEFAULT_TOKENS)
    args.dtype = args.dtype or ("fp32" if args.smoke else "bf16")
    args.iters = args.iters or (3 if args.smoke else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    args.check = args.check or args.smoke
    return args


def main(argv=None) -> int:
    """Run under torchrun, one process per device (NCCL on GPUs, gloo on the CPU)."""
    args = parse_args(argv)
    failed = False
    with torchrun_process_group() as device:
        t0 = time.perf_counter()
        rows = run_layer_bench(args.tokens, args.hidden, args.num_experts, args.top_k, args.moe_inter,
                               args.n_group, args.topk_group, args.shared_experts, args.routed_scaling_factor,
                               DTYPES[args.dtype], args.backends, args.kernel_backend, args.iters, args.warmup,
                               args.seed, args.check, device=device)
        if dist.get_rank() == 0:
            cfg = {k: v for k, v in vars(args).items() if k != "out"}
            cfg.update(world_size=dist.get_world_size(), backend=str(dist.get_backend()),
                       device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       torch=torch.__version__, elapsed_s=round(time.perf_counter() - t0, 1))
            print(f"moe layer EP bench: {cfg}")
            print(format_table(rows))
            if args.check:
                worst = max((r["rel_err"] for r in rows), default=0.0)
                ok = worst <= CHECK_TOL[args.dtype]
                print(f"check: ||EP - all experts on one rank|| / ||one rank|| <= {worst:.3g} (max abs "
                      f"{max((r['max_abs_err'] for r in rows), default=0.0):.3g}): "
                      f"{'ok' if ok else 'FAILED'}, tolerance {CHECK_TOL[args.dtype]}")
                failed = not ok
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump({"config": cfg, "results": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
