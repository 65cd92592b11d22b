"""The `moe` console command, as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run_moe(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moe.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_generate_on_builtin_tiny_model(tmp_path):
    r = run_moe("generate", "--model", "tiny-qwen3-moe", "Hello", "--max-tokens", "5", "--json",
                "--prompt-token-ids", "[1, 5, 9]", env={"MOE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert lines[0]["prompt"] == "Hello" and len(lines[0]["outputs"][0]["token_ids"]) <= 5
    assert lines[1]["prompt_token_ids"] == [1, 5, 9]
    assert os.path.isfile(tmp_path / "tiny-qwen3-moe" / "config.json")


def test_generate_reports_errors_without_traceback(tmp_path):
    r = run_moe("generate", "--model", str(tmp_path / "missing"), "Hello")
    assert r.returncode == 1
    assert "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = run_moe("generate", "--model", "tiny-qwen3-moe", "Hi", "--temperature", "-1",
                env={"MOE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 1 and "invalid sampling parameter temperature" in r.stderr


def test_bench_subcommand_runs_a_benchmark():
    r = run_moe("bench", "scheduler", "--steps", "3", "--num-running", "8")
    assert r.returncode == 0, r.stderr
    assert "median ms" in r.stdout and len(r.stdout.strip().splitlines()) == 3
