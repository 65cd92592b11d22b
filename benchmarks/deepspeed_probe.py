"""GPU smoke test of backend="deepspeed" (kernels/deepspeed_moe.py), in one command:

    python benchmarks/deepspeed_probe.py

1. the library: .dsk/libdeepspeedft.so.xz (untracked, carried next to the tree) is decompressed to
   /tmp and MOE_DEEPSPEED_FT_LIB points at it (unless already set); else the installed wheel;
2. which SM architectures its fatbin holds (cuobjdump --list-elf when present, else the fatbin
   headers read directly);
3. the GPU tests of tests/kernels/test_deepspeed_backend.py;
4. the Qwen3-30B-A3B expert layer (E=128, D=2048, F=768, top-8) at M=64 tokens, bf16: median of 20
   CUDA-event timings, eager and CUDA-graph replay, and the relative error against the reference.

Steps 3 and 4 run in child processes: a C++ exception inside the library cannot cross ctypes and
aborts the process, and its text ("terminate called ... what(): ...") is then printed from the
child's stderr, with the signal, as the exact reason.
"""
from __future__ import annotations

import collections
import lzma
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRIED = os.path.join(ROOT, ".dsk", "libdeepspeedft.so.xz")
UNPACKED = "/tmp/libdeepspeedft.so"
E, D, F, TOPK, M = 128, 2048, 768, 8, 64


def prepare_library() -> str | None:
    if os.environ.get("MOE_DEEPSPEED_FT_LIB"):
        return os.environ["MOE_DEEPSPEED_FT_LIB"]
    if os.path.isfile(CARRIED):
        with lzma.open(CARRIED) as src, open(UNPACKED, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
        os.environ["MOE_DEEPSPEED_FT_LIB"] = UNPACKED
        return UNPACKED
    sys.path.insert(0, ROOT)
    from kernels.deepspeed_moe import library_path
    return library_path()


def fatbin_archs(path: str) -> collections.Counter:
    """(kind, sm) -> count, from the fatbin headers of the .nv_fatbin section (no CUDA toolkit needed)."""
    data = open(path, "rb").read()
    shoff, = struct.unpack_from("<Q", data, 0x28)  # ELF64: the section header table
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def section(i):  # (name offset, file offset, size) of section i
        base = shoff + i * shentsize
        return struct.unpack_from("<I", data, base)[0], *struct.unpack_from("<QQ", data, base + 24)

    names = section(shstrndx)[1]
    for i in range(shnum):
        name, off, size = section(i)
        if data[names + name:data.index(b"\0", names + name)] == b".nv_fatbin":
            break
    else:
        raise ValueError(f"{path} has no .nv_fatbin section")
    end = off + size
    counts = collections.Counter()
    while off + 16 <= end:
        magic, _, header, size = struct.unpack_from("<IHHQ", data, off)
        if magic != 0xBA55ED50:
            off += 8
            continue
        entry, stop = off + header, off + header + size
        while entry < stop:  # entry header: kind u16, _, header size u32, payload u64, ..., arch u32 @28
            kind, _, ehead, payload = struct.unpack_from("<HHIQ", data, entry)
            counts[({1: "PTX", 2: "SASS"}.get(kind, str(kind)), struct.unpack_from("<I", data, entry + 28)[0])] += 1
            entry += ehead + payload
        off = stop
    return counts


def list_archs(path: str) -> None:
    if shutil.which("cuobjdump"):
        r = subprocess.run(["cuobjdump", "--list-elf", path], capture_output=True, text=True)
        archs = collections.Counter(re.findall(r"sm_\d+a?", r.stdout))
        print(f"cuobjdump --list-elf: {sum(archs.values())} ELF images, by arch: {dict(sorted(archs.items()))}")
        if r.returncode:
            print(f"cuobjdump rc={r.returncode}: {r.stderr.strip()}")
        return
    print("cuobjdump not found; fatbin headers:")
    try:
        for (kind, sm), n in sorted(fatbin_archs(path).items()):
            print(f"  {kind} sm_{sm}: {n}")
    except Exception:
        traceback.print_exc()


def run_child(title: str, argv: list[str], timeout: int) -> int:
    print(f"\n=== {title}: {' '.join(argv)}", flush=True)
    try:
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"TIMEOUT after {timeout}s\n{e.stdout or ''}\n{e.stderr or ''}")
        return 124
    print(r.stdout, end="")
    if r.stderr.strip():
        print(f"--- stderr:\n{r.stderr}", end="")
    if r.returncode < 0:
        print(f"--- killed by {signal.Signals(-r.returncode).name} (an abort here is a C++ exception "
              "from the library: see 'what():' above)")
    print(f"--- rc={r.returncode}", flush=True)
    return r.returncode


def bench() -> None:
    """Child process: time fused_experts_deepspeed on the Qwen3-30B-A3B expert layer."""
    sys.path.insert(0, ROOT)
    import torch

    from kernels.deepspeed_moe import fused_experts_deepspeed, library_path
    from kernels.reference import fused_experts_torch

    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, cc {torch.cuda.get_device_capability(dev)}, "
          f"library {library_path()}")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, D, device=dev, generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).bfloat16()
    w2 = (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).bfloat16()
    w, ids = torch.softmax(torch.randn(M, E, device=dev, generator=g), -1).topk(TOPK, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    call = lambda: fused_experts_deepspeed(x, w13, w2, w, ids)  # noqa: E731

    out = call()
    torch.cuda.synchronize()
    ref = fused_experts_torch(x, w13, w2, w, ids)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"E={E} D={D} F={F} top-{TOPK} M={M} bf16: rel error vs fused_experts_torch = {rel:.3e}, "
          f"finite={bool(torch.isfinite(out).all())}")

    def median_us(fn, n=20, warmup=3):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(n):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1e3)
        return sorted(times)[n // 2]

    print(f"eager (incl. python + host heuristic): median {median_us(call):.1f} us")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    graph.replay()
    torch.cuda.synchronize()
    print(f"CUDA graph replay: median {median_us(graph.replay):.1f} us, "
          f"max |replay - eager| = {(static_out.float() - out.float()).abs().max().item():.3e}")


def main() -> int:
    try:
        path = prepare_library()
        size = f" ({os.path.getsize(path) / 2**20:.0f} MiB)" if path and os.path.isfile(path) else ""
        print(f"library: {path}{size}")
        if path and os.path.isfile(path):
            list_archs(path)
    except Exception:
        traceback.print_exc()
    rc_tests = run_child("GPU tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                                       "tests/kernels/test_deepspeed_backend.py", "-k", "gpu"], timeout=420)
    rc_bench = run_child("Qwen3-30B-A3B expert layer", [sys.executable, os.path.abspath(__file__), "--bench"],
                         timeout=300)
    return rc_tests or rc_bench


if __name__ == "__main__":
    if sys.argv[1:] == ["--bench"]:
        try:
            bench()
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    else:
        sys.exit(main())
