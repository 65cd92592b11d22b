"""benchmarks/serve_gpu_bench.py end to end on the CPU, as the GPU stage runs it but tiny: a
config-only checkpoint with dummy weights (so the built-in tiny model's tokenizer is used), the
offline run, then `moe serve` driven by `moe bench serve`: with 2 API processes on random prompts, with 1
on a ShareGPT file."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.serve.helpers import ROOT


def test_serve_gpu_bench_script_on_the_cpu(tmp_path):
    from models.tiny import ensure_tiny_model

    ckpt = tmp_path / "dummy"
    ckpt.mkdir()
    shutil.copy(os.path.join(ensure_tiny_model("tiny-qwen3-moe"), "config.json"), ckpt)
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/serve_gpu_bench.py", str(ckpt), "--out-dir", str(out), "--num-prompts", "8",
           "--input-len", "12", "--output-len", "4", "--api-server-counts", "2", "--deadline-s", "150",
           "--engine-args=--load-format dummy --device cpu --max-model-len 128 --kv-cache-memory-bytes 16777216"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokenizer"] == ensure_tiny_model("tiny-qwen3-moe")  # the dummy has none of its own
    offline = summary["offline"]
    assert offline["total_prompt_tokens"] == 8 * 12 and offline["total_output_tokens"] == 8 * 4
    assert set(summary["configs"]) == {"api_servers_2"}
    for row in summary["configs"].values():
        assert row["completed"] == 8 and row["failed"] == 0 and row["prompt_format"] == "text"
        assert row["total_input_tokens"] == 8 * 12 and row["total_output_tokens"] == 8 * 4  # as the server counted
        assert row["serving_vs_offline"] == row["output_throughput"] / offline["output_throughput"] > 0
        assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"] and row["mean_tpot_ms"] > 0
    assert (out / "serve_api2.json").is_file() and "api_servers_2" in run.stdout


def test_serve_gpu_bench_script_on_a_sharegpt_file(tmp_path):
    from models.tiny import ensure_tiny_model
    from moe.bench.datasets import sharegpt_requests
    from moe.engine.tokenizer import load_tokenizer

    data = [{"conversations": [{"from": "human", "value": f"Question {i}: " + "what is an expert " * (1 + i % 3)},
                               {"from": "gpt", "value": "Experts are " * (2 + i % 4)}]} for i in range(10)]
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text(json.dumps(data))
    ckpt = tmp_path / "dummy"
    ckpt.mkdir()
    shutil.copy(os.path.join(ensure_tiny_model("tiny-qwen3-moe"), "config.json"), ckpt)
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/serve_gpu_bench.py", str(ckpt), "--out-dir", str(out), "--num-prompts", "6",
           "--dataset-path", str(dataset), "--seed", "5", "--api-server-counts", "1", "--deadline-s", "150",
           "--engine-args=--load-format dummy --device cpu --max-model-len 256 --kv-cache-memory-bytes 16777216"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = sharegpt_requests(str(dataset), 6, load_tokenizer(ensure_tiny_model("tiny-qwen3-moe")), seed=5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workload"]["dataset_path"] == str(dataset)
    for row in (summary["offline"], summary["configs"]["api_servers_1"]):
        assert row["total_output_tokens"] == sum(r.output_len for r in want)
    assert summary["offline"]["total_prompt_tokens"] == sum(r.prompt_len for r in want)
    assert summary["configs"]["api_servers_1"]["total_input_tokens"] == sum(r.prompt_len for r in want)
