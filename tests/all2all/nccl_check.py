"""NCCL correctness of the dispatchers, on GPUs (not collected by pytest: needs torchrun).

    PYTHONPATH=. torchrun --nproc-per-node=2 tests/all2all/nccl_check.py

1. Every case of a2a_cases.py (fp32, tiny shapes, uneven / empty ranks, both placements) on
   the NCCL group, exact to 1e-5 against single-process `fused_experts`.
2. bf16 at the benchmark's shapes (D=7168, top-8 of 256, uneven T per rank): dispatch ->
   reference experts on this rank's experts -> combine, against single-process `fused_experts`
   with all experts, in bf16 tolerances; also T=0 on one rank.
Prints one line per rank; exits 1 on any failure.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from all2all import make_dispatcher  # noqa: E402
from kernels import fused_experts  # noqa: E402
from routing.placement import local_expert_ids, make_expert_map  # noqa: E402
from tests.all2all.a2a_cases import run_cases  # noqa: E402


def bf16_case(rank: int, ep: int, backend: str, counts: list[int], D=7168, F=64, E=256, K=8) -> str | None:
    dev = torch.device("cuda", torch.cuda.current_device()) if _CUDA else torch.device("cpu")
    g = torch.Generator().manual_seed(99)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.05).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, D, F, generator=g) * 0.05).to(dev, torch.bfloat16)
    per_rank = []
    for T in counts:
        x = torch.randn(T, D, generator=g).to(dev, torch.bfloat16)
        s = torch.rand(T, E, generator=g)
        w, ids = s.topk(K, dim=1)
        per_rank.append((x, w.softmax(1).to(dev), ids.to(dev)))
    x, w, ids = per_rank[rank]
    disp = make_dispatcher(backend, None, E, "linear")
    local = torch.tensor(local_expert_ids(E, ep, rank, "linear"), device=dev)
    recv = disp.dispatch(x, w, ids)
    y = fused_experts(recv.x_RD.contiguous(), w13[local], w2[local], recv.topk_weights_RK,
                      recv.topk_ids_RK, expert_map=make_expert_map(E, ep, rank).to(dev), backend="torch")
    out = disp.combine(y, recv)
    want = fused_experts(x, w13, w2, w, ids, backend="torch")
    try:
        assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, out.dtype)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    except AssertionError as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


_CUDA = torch.cuda.is_available()  # without GPUs it runs on gloo (to check the script itself)


def main() -> int:
    if _CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if _CUDA else "gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    try:
        res = run_cases(rank, ep, device="cuda" if _CUDA else "cpu", backends=("allgather_reducescatter", "all_to_all"))
        for backend in ("allgather_reducescatter", "all_to_all"):
            for counts in ([300, 170, 64, 1][:ep], [0, 129, 5, 7][:ep]):
                res[f"bf16-{backend}-{counts}"] = bf16_case(rank, ep, backend, counts)
        if _CUDA:
            torch.cuda.synchronize()
        bad = {k: v for k, v in res.items() if v is not None}
        print(f"nccl_check rank {rank}: {len(res) - len(bad)}/{len(res)} passed"
              + (f"; FAILED: {bad}" if bad else ""), flush=True)
    finally:
        dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
