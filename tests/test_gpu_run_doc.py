"""docs/benchmarks.md's table of benchmarks/gpu_run.sh stages names every stage the script runs."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def script_stages() -> set[str]:
    with open(os.path.join(ROOT, "benchmarks", "gpu_run.sh")) as f:
        text = f.read()
    body = text[text.index('for stage in "$@"; do'):]
    return set(re.findall(r"^    ([a-z0-9-]+)\)", body, re.M))


def documented_stages() -> set[str]:
    with open(os.path.join(ROOT, "docs", "benchmarks.md")) as f:
        return set(re.findall(r"^\| `([a-z0-9-]+)` \|", f.read(), re.M))


def test_every_gpu_run_stage_is_documented():
    stages = script_stages()
    assert {"engine", "hybrid", "mxfp4", "serve-poisson"} <= stages  # the parser finds them
    assert stages - documented_stages() == set(), "stages of gpu_run.sh missing from docs/benchmarks.md"
