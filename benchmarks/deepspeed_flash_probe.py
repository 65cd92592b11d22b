"""DeepSpeed-FastGen's blocked flash attention (kernels/deepspeed_flash.py) as a contender beside the
Triton paged-attention kernels, on one GPU, in one command:

    python benchmarks/deepspeed_flash_probe.py --out results/deepspeed_flash_h200.json

1. the library: $MOE_DEEPSPEED_FLASH_LIB, else .dsk/libblockedflash.so.xz (untracked, carried next to
   the tree; decompressed to /tmp), else the installed `deepspeed-kernels` wheel;
2. which SM architectures its fatbin holds;
3. in a child process (a C++ exception inside the library aborts its process; the child's stderr
   then shows it): Qwen3-30B-A3B attention (H=32, G=4, d=128, bf16) on a shuffled blocked cache with
   the block size the library's kernels are compiled for (64 tokens on sm_90): decode batches,
   fresh prefills and chunked prefills over cached context. Both kernels read the same cache; each
   output is checked against an fp32 reference; times are triton.testing.do_bench medians of
   CUDA-graph replays (eager when a capture fails, marked so); the atoms are built once per case,
   outside the timing, as DeepSpeed prepares them per step on the host.
"""
from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.deepspeed_probe import fatbin_archs, run_child  # noqa: E402

CARRIED = os.path.join(ROOT, ".dsk", "libblockedflash.so.xz")
UNPACKED = "/tmp/libblockedflash.so"
H, G, D = 32, 4, 128
HBM_BPS, PEAK_FLOPS = 4.8e12, 700e12
# (kind, sequences, new tokens each, cached tokens before them)
CASES = [("decode", 1, 1, 575), ("decode", 32, 1, 2047), ("decode", 256, 1, 511), ("decode", 256, 1, 2047),
         ("prefill", 8, 1024, 0), ("prefill", 1, 8192, 0), ("chunked", 4, 1024, 1024)]


def prepare_library() -> str | None:
    from kernels.deepspeed_flash import LIB_ENV, library_path
    if not os.environ.get(LIB_ENV) and os.path.isfile(CARRIED):
        with lzma.open(CARRIED) as src, open(UNPACKED, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        os.environ[LIB_ENV] = UNPACKED
    return library_path()


def _problem(torch, nseq, new, cached, S, seed):
    """Shuffled blocked cache holding every sequence's cached + new tokens, its int32 tables, and
    the queries of the new tokens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    L = cached + new
    nblk = -(-L // S)
    N = nseq * nblk
    cache = torch.randn(2, N, S, G, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(N, device="cuda", generator=gen).to(torch.int32).view(nseq, nblk).contiguous()
    q = torch.randn(nseq * new, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return cache, tables, q


def _reference(torch, cache, tables, q, nseq, new, cached, scale):
    """fp32 causal attention of each sequence's new queries over its context."""
    L, out = cached + new, []
    for b in range(nseq):
        kv = cache[:, tables[b].long()].reshape(2, -1, G, D)[:, :L].float()  # [2, L, G, d]
        k, v = kv[0].repeat_interleave(H // G, dim=1), kv[1].repeat_interleave(H // G, dim=1)
        qb = q[b * new:(b + 1) * new].float()
        s = torch.einsum("qhd,khd->hqk", qb, k) * scale
        pos_q = torch.arange(cached, L, device="cuda")[:, None]
        s = s.masked_fill(torch.arange(L, device="cuda")[None, :] > pos_q, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(out)


def _time(torch, do_bench, fn):
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3, "eager"


def bench(out_path: str) -> None:
    """Child process: both kernels on every case."""
    import torch
    from triton.testing import do_bench

    from kernels.deepspeed_flash import blocked_flash_attention, build_atoms, kv_block_size, q_block_size
    from kernels.triton_attention.decode import paged_attention_decode_triton
    from kernels.triton_attention.prefill import paged_attention_prefill_triton

    cc = torch.cuda.get_device_capability()
    S, QB = kv_block_size(D, cc), q_block_size(D, cc)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, cc {cc}; kernels compiled for KV blocks "
          f"of {S} and {QB} queries per atom at d={D}", flush=True)
    scale = D ** -0.5
    rows = []
    for kind, nseq, new, cached in CASES:
        cache, tables, q = _problem(torch, nseq, new, cached, S, seed=nseq * 31 + new + cached)
        L = cached + new
        qsl = [b * new for b in range(nseq + 1)]
        lens = [L] * nseq
        atoms = build_atoms(tables, qsl, lens, QB, S)
        ref = _reference(torch, cache, tables, q, nseq, new, cached, scale)
        ds_out, ours_out = torch.empty_like(q), torch.empty_like(q)
        lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
        if kind == "decode":
            def ours():
                paged_attention_decode_triton(q, cache, tables, lens_t, scale, out_BHd=ours_out)
        else:
            qsl_t = torch.tensor(qsl, dtype=torch.int32, device="cuda")

            def ours():
                paged_attention_prefill_triton(q, cache, tables, qsl_t, lens_t, new, scale, out_THd=ours_out)

        def contender():
            blocked_flash_attention(q, cache, atoms, scale, out_THd=ds_out)
        row = {"kind": kind, "seqs": nseq, "new_tokens": new, "cached_tokens": cached, "block_size": S,
               "atoms": atoms.shape[0]}
        for name, fn, out in (("triton", ours, ours_out), ("deepspeed", contender, ds_out)):
            us, mode = _time(torch, do_bench, fn)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row[f"{name}_us"], row[f"{name}_timing"], row[f"{name}_rel_err"] = us, mode, err
        if kind == "decode":
            row["floor_us"] = 2 * nseq * L * G * D * 2 / HBM_BPS * 1e6
        else:
            row["floor_us"] = 4 * H * D * nseq * sum(cached + i + 1 for i in range(new)) / PEAK_FLOPS * 1e6
        rows.append(row)
        print(f"{kind:8s} {nseq:4d} x {new:5d} new on {cached:5d}: triton {row['triton_us']:8.1f} us "
              f"(err {row['triton_rel_err']:.1e}), deepspeed {row['deepspeed_us']:8.1f} us "
              f"(err {row['deepspeed_rel_err']:.1e}, {row['deepspeed_timing']}), floor {row['floor_us']:.1f} us",
              flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="deepspeed_flash.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        bench(a.out)
        return 0
    path = prepare_library()
    if path is None:
        print("libblockedflash.so not found: install deepspeed-kernels, carry .dsk/libblockedflash.so.xz or set "
              "MOE_DEEPSPEED_FLASH_LIB")
        return 1
    print(f"library {path}; fatbin {dict(fatbin_archs(path))}", flush=True)
    return run_child("blocked flash against the Triton kernels",
                     [sys.executable, os.path.abspath(__file__), "--child", "--out", a.out], timeout=500)


if __name__ == "__main__":
    sys.exit(main())
