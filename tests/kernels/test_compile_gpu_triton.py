"""The compile-for-sm_90 scripts (tests/kernels/compile_sm90*.py, no GPU needed) under the Triton the GPU
machines run, beside the tests that check their reports under the installed one: a kernel can compile with
one Triton and not the other (before 3.9 a branch that a constexpr rules out at run time is still compiled;
the down GEMM's half-tile branch with TMA descriptors failed so on an H100 only).

MOE_TRITON_GPU_PATH names a folder holding that Triton (`pip install --no-deps --target DIR triton==3.6.0`;
.ci/run makes one); without it these tests skip."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_GPU_PATH = os.environ.get("MOE_TRITON_GPU_PATH")
SCRIPTS = sorted(p.name for p in Path(__file__).parent.glob("compile_sm90*.py"))


def _reports(obj):
    """Every dict inside a script's JSON report."""
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _reports(v)


def test_the_scripts_are_found():
    assert {"compile_sm90.py", "compile_sm90_attention.py", "compile_sm90_down_tma.py",
            "compile_sm90_mxfp4.py"} <= set(SCRIPTS)


@pytest.mark.skipif(not TRITON_GPU_PATH, reason="MOE_TRITON_GPU_PATH unset (a folder holding the GPU machines' Triton)")
@pytest.mark.parametrize("script", SCRIPTS)
def test_compiles_for_sm90_under_the_gpu_machines_triton(script):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([TRITON_GPU_PATH] + [p for p in [env.get("PYTHONPATH")] if p])
    version = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__, triton.__file__)"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert version.returncode == 0 and version.stdout.split()[1].startswith(TRITON_GPU_PATH), version
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name(script))], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"Triton {version.stdout.split()[0]}: {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report, "an empty report"
    assert all(r.get("compiled", True) for r in _reports(report)), report
