"""The loader of the native CPU kernels (kernels/cpu_native): built once per source, compiler, flags
and CPU, cached, and None (the torch path) when it cannot be built or is switched off."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from kernels import cpu_native


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """library() recomputed with an empty cache folder; the real one restored afterwards."""
    monkeypatch.setenv("MOE_CPU_NATIVE_CACHE", str(tmp_path))
    cpu_native.library.cache_clear()
    yield tmp_path
    cpu_native.library.cache_clear()


def test_builds_once_into_the_cache(fresh_loader, monkeypatch):
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    lib = cpu_native.library()
    assert lib is not None and hasattr(lib, "moe_paged_decode_f32")
    built = list(fresh_loader.glob("cpu_native-*.so"))
    assert len(built) == 1
    cpu_native.library.cache_clear()
    monkeypatch.setattr(cpu_native, "_build", lambda *a: pytest.fail("rebuilt although cached"))
    assert cpu_native.library() is not None


def test_key_names_the_cpu(fresh_loader, monkeypatch):
    """Another CPU's flags name another file: a cache shared between machines is never loaded
    on a CPU it was not built for."""
    if cpu_native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    cpu_native.library()
    monkeypatch.setattr(cpu_native, "_cpu_flags", lambda: "flags: some other cpu")
    cpu_native.library.cache_clear()
    cpu_native.library()
    assert len(list(fresh_loader.glob("cpu_native-*.so"))) == 2


def test_switched_off_or_no_compiler_or_failed_build_gives_none(fresh_loader, monkeypatch, caplog):
    monkeypatch.setenv("MOE_CPU_NATIVE", "0")
    assert cpu_native.library() is None
    monkeypatch.delenv("MOE_CPU_NATIVE")
    cpu_native.library.cache_clear()
    monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    assert cpu_native.library() is None
    cpu_native.library.cache_clear()
    monkeypatch.setattr(cpu_native, "_compiler", lambda: "false")  # a "compiler" that always fails
    monkeypatch.setattr(cpu_native.subprocess, "run", _failing_run)
    with caplog.at_level(logging.WARNING, logger="moe.cpu_native"):
        assert cpu_native.library() is None
    assert "building the native CPU kernels failed" in caplog.text
    assert not list(fresh_loader.glob("*.so")), "nothing half-built is left in the cache"


def _failing_run(cmd, **kwargs):
    import subprocess

    if "--version" in cmd:
        return subprocess.CompletedProcess(cmd, 0, stdout="cc 1.0", stderr="")
    raise subprocess.CalledProcessError(1, cmd, stderr="error: no such compiler")


def test_loading_keeps_subnormals(fresh_loader):
    """The library is linked without -ffast-math's crtfastmath.o, whose constructor would turn on
    flush-to-zero / denormals-are-zero for the whole process: an fp32 subnormal still reads as one
    after it loads (checked in a fresh process, the flags being per thread and inherited)."""
    code = ("import numpy as np; from kernels import cpu_native; assert cpu_native.library() is not None; "
            "print(float(np.float32(2.0 ** -127) * np.float32(2.0 ** 127)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MOE_CPU_NATIVE_CACHE": str(fresh_loader)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1.0", "loading the native kernels flushed fp32 subnormals"
