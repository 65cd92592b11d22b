"""The `moe` console command, as a user runs it."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def run_moe(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moe.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


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


def test_bench_help_lists_the_benchmarks_and_each_usage_names_its_own():
    r = run_moe("bench", "--help")
    assert r.returncode == 0, r.stderr
    for name in ("throughput", "latency", "scheduler", "kernel", "all2all"):
        assert name in r.stdout
    text = " ".join(r.stdout.split())
    assert "needs a CUDA GPU" in text and "torchrun" in text
    r = run_moe("bench", "latency", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: moe bench latency")
    assert "--num-iters-warmup" in r.stdout and "--max-num-seqs" in r.stdout and "--load-format" in r.stdout


def test_generate_help_shows_defaults():
    r = run_moe("generate", "--help")
    assert r.returncode == 0 and "(default: 32)" in r.stdout  # --max-tokens


def test_generate_checks_its_input_before_loading_the_model(tmp_path):
    # A missing model folder would fail later: each error below must come first.
    missing = str(tmp_path / "missing")
    r = run_moe("generate", "--model", missing, "--prompt-token-ids", "[1, x]")
    assert r.returncode == 1 and "e.g. '[1, 5, 9]'" in r.stderr and "does not exist" not in r.stderr
    r = run_moe("generate", "--model", missing)
    assert r.returncode == 1 and "give at least one prompt" in r.stderr
    r = run_moe("generate", "--model", missing, "Hi", "--top-p", "2")
    assert r.returncode == 1 and "invalid sampling parameter top_p" in r.stderr and "Traceback" not in r.stderr


def test_generate_json_includes_logprobs(tmp_path):
    r = run_moe("generate", "--model", "tiny-qwen3-moe", "--prompt-token-ids", "[1, 5, 9]", "--max-tokens", "3",
                "--ignore-eos", "--json", "--logprobs", "2", env={"MOE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])["outputs"][0]
    assert len(out["token_ids"]) == 3 and len(out["logprobs"]) == 3
    for token, step in zip(out["token_ids"], out["logprobs"]):
        assert str(token) in step and all(lp <= 0 for lp in step.values())
