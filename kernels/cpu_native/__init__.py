"""Native kernels of the CPU path: C sources in this folder, compiled with the machine's C compiler
on first use (for this CPU: -march=native, OpenMP) and loaded with ctypes.

The CPU path's decode steps are a few hundred microsecond-sized torch ops per layer, each paying
its dispatch and the memory of a gathered intermediate; a C loop over the paged cache does the same
work without either. Every kernel here has its torch twin in kernels/ (the reference the tests hold it
to, and the fallback): with no compiler, a failed build, MOE_CPU_NATIVE=0, or a dtype the kernel does
not take, the torch path runs.

The shared object is cached under $MOE_CPU_NATIVE_CACHE (default ~/.cache/moe-runtime), named by a
hash of the sources, the compiler's version, the flags and the CPU's feature flags, so a cache
shared between machines never loads code built for another CPU. The OpenMP runtime is the one
torch already loaded (same soname), so the kernels share torch's threads instead of adding theirs.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("moe.cpu_native")

SOURCES = ["paged_decode.c", "norm_rope.c", "experts.c"]
COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: with it the driver links crtfastmath.o, whose constructor turns on
# flush-to-zero / denormals-are-zero for the whole process when the library loads (every later
# fp32 subnormal in torch or numpy would read as zero).
LINK_FLAGS = ["-fopenmp", "-shared"]


def enabled() -> bool:
    return os.environ.get("MOE_CPU_NATIVE", "1") != "0"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(cc: str, out: Path) -> None:
    src_dir = Path(__file__).parent
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory(dir=out.parent) as objs:
        try:
            obj_files = [os.path.join(objs, Path(s).with_suffix(".o").name) for s in SOURCES]
            for src, obj in zip(SOURCES, obj_files):
                subprocess.run([cc, *COMPILE_FLAGS, "-c", "-o", obj, str(src_dir / src)], check=True,
                               capture_output=True, text=True, timeout=120)
            subprocess.run([cc, *LINK_FLAGS, "-o", tmp, *obj_files, "-lm"], check=True, capture_output=True, text=True,
                           timeout=120)
            os.replace(tmp, out)  # atomic: another process may be building the same file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (no compiler, a failed build, or MOE_CPU_NATIVE=0)."""
    if not enabled():
        return None
    cc = _compiler()
    if cc is None:
        logger.info("no C compiler found: the CPU path runs its torch kernels")
        return None
    try:
        import torch  # noqa: F401  (loads torch's OpenMP runtime first, which the library then shares)

        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256()
        for s in SOURCES:
            key.update((Path(__file__).parent / s).read_bytes())
        key.update("\0".join([version, *COMPILE_FLAGS, "|", *LINK_FLAGS, _cpu_flags()]).encode())
        cache = Path(os.environ.get("MOE_CPU_NATIVE_CACHE", Path.home() / ".cache" / "moe-runtime"))
        path = cache / f"cpu_native-{key.hexdigest()[:16]}.so"
        if not path.exists():
            _build(cc, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the native CPU kernels failed (%s): the CPU path runs its torch kernels", detail)
        return None
