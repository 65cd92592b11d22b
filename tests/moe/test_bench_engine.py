"""`moe bench throughput` and `moe bench latency` on the CPU: the function API and the command
line, with the built-in tiny model and with a folder holding only config.json (dummy weights);
throughput's --random-range-ratio (per-request lengths, as `moe bench serve` draws them)."""
from __future__ import annotations

import json
import random

import pytest

from models.tiny import TINY_QWEN3_MOE_CONFIG
from moe.bench import latency, serve, throughput

ENGINE = {"model": "tiny-qwen3-moe", "device": "cpu", "dtype": "float32", "max_num_seqs": 4}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_run_throughput_counts_every_token(cache_dir):
    r = throughput.run_throughput(ENGINE, input_len=5, output_len=3, num_prompts=6, seed=1)
    assert r["num_requests"] == 6
    assert r["total_prompt_tokens"] == 6 * 5 and r["total_output_tokens"] == 6 * 3  # ignore_eos: exact
    assert r["total_num_tokens"] == 6 * 8
    assert r["elapsed_time"] > 0
    assert r["requests_per_second"] == pytest.approx(6 / r["elapsed_time"])
    assert r["tokens_per_second"] == pytest.approx(48 / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(18 / r["elapsed_time"])
    w = r["workload"]  # range ratio 0 (the default): every request the same lengths
    assert w["random_range_ratio"] == 0.0 and w["input_lens"] == [5] * 6 and w["output_lens"] == [3] * 6


def test_throughput_command_line_on_a_config_only_folder(cache_dir, capsys):
    folder = cache_dir / "shape-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_QWEN3_MOE_CONFIG))
    out = cache_dir / "r.json"
    rc = throughput.main(["--model", str(folder), "--load-format", "dummy", "--device", "cpu", "--num-prompts", "3",
                          "--input-len", "4", "--output-len", "2", "--max-num-seqs", "2", "--output-json", str(out),
                          "--disable-tqdm"])
    assert rc == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("Throughput: ") and "requests/s" in line and "total tokens/s" in line \
        and line.endswith("output tokens/s")
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["total_output_tokens"], r["total_num_tokens"]) == (3, 6, 18)
    assert r["engine_kwargs"]["load_format"] == "dummy" and r["engine_kwargs"]["max_num_seqs"] == 2


def test_throughput_range_ratio_varies_the_lengths_and_counts_them(cache_dir):
    L_in, L_out, R, n = 12, 6, 0.5, 10
    r = throughput.run_throughput(ENGINE, input_len=L_in, output_len=L_out, num_prompts=n, seed=3, range_ratio=R)
    w = r["workload"]
    ins, outs = w["input_lens"], w["output_lens"]
    assert len(ins) == len(outs) == n == r["num_requests"] and w["random_range_ratio"] == R
    assert all(L_in * (1 - R) <= x <= L_in * (1 + R) for x in ins) and len(set(ins)) > 1
    assert all(L_out * (1 - R) <= x <= L_out * (1 + R) for x in outs) and len(set(outs)) > 1
    # what the engine saw and generated (ignore_eos: exactly the lengths asked for)
    assert r["total_prompt_tokens"] == sum(ins) and r["total_output_tokens"] == sum(outs)
    assert r["total_num_tokens"] == sum(ins) + sum(outs)
    assert r["tokens_per_second"] == pytest.approx(r["total_num_tokens"] / r["elapsed_time"])
    assert r["output_tokens_per_second"] == pytest.approx(sum(outs) / r["elapsed_time"])
    assert r["requests_per_second"] == pytest.approx(n / r["elapsed_time"])
    # one definition with `moe bench serve`: the same seed draws the same lengths there
    import argparse
    args = argparse.Namespace(seed=3, num_prompts=n, random_input_len=L_in, random_output_len=L_out,
                              random_range_ratio=R, random_prefix_len=0, vocab_size=500)
    assert [(len(p), o) for p, o in serve.random_requests(args)] == list(zip(ins, outs))


def test_throughput_command_line_range_ratio(cache_dir, capsys):
    out = cache_dir / "rr.json"
    rc = throughput.main(["--device", "cpu", "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                          "--random-range-ratio", "0.75", "--seed", "1", "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    r = json.loads(out.read_text())
    ins, outs = r["workload"]["input_lens"], r["workload"]["output_lens"]
    assert all(2 <= x <= 14 for x in ins) and all(1 <= x <= 7 for x in outs) and len(set(ins + outs)) > 1
    assert lines[1] == f"Total num prompt tokens:  {sum(ins)}" and lines[2] == f"Total num output tokens:  {sum(outs)}"
    assert (r["total_prompt_tokens"], r["total_output_tokens"]) == (sum(ins), sum(outs))
    assert set(r) >= {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second"}


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_invalid_range_ratio_is_refused(ratio, capsys):
    with pytest.raises(ValueError, match=r"--random-range-ratio must lie in \[0, 1\)"):
        throughput.run_throughput({"model": "/nonexistent"}, 4, 2, 1, range_ratio=ratio)  # before the engine
    with pytest.raises(SystemExit) as exc:
        throughput.main(["--model", "/nonexistent", "--random-range-ratio", str(ratio)])
    assert exc.value.code == 2 and "--random-range-ratio must lie in [0, 1)" in capsys.readouterr().err


def test_random_prefix_len_begins_every_prompt_with_the_same_tokens(cache_dir):
    from moe.bench.engine_workload import random_token_requests

    r = throughput.run_throughput(ENGINE, input_len=6, output_len=2, num_prompts=5, seed=4, range_ratio=0.5,
                                  prefix_len=20)
    w = r["workload"]
    assert w["random_prefix_len"] == 20 and all(20 + 3 <= n <= 20 + 9 for n in w["input_lens"])
    assert r["total_prompt_tokens"] == sum(w["input_lens"])
    prompts = [p["prompt_token_ids"] for p, _ in random_token_requests(5, 6, 2, 500, 4, 0.5, prefix_len=20)]
    assert [len(p) for p in prompts] == w["input_lens"]
    assert all(p[:20] == prompts[0][:20] for p in prompts) and len({tuple(p[20:]) for p in prompts}) == 5
    # without a prefix: the lengths drawn as before (the prefix's tokens are drawn after them)
    plain = random_token_requests(5, 6, 2, 500, 4, 0.5)
    assert [len(p["prompt_token_ids"]) + 20 for p, _ in plain] == w["input_lens"]
    with pytest.raises(ValueError, match="random dataset only"):
        throughput.run_throughput({"model": "/nonexistent"}, None, None, 2, dataset_name="sharegpt",
                                  dataset_path="x.json", prefix_len=4)


def test_bench_serve_random_prefix_len_text_and_token_ids(cache_dir):
    from models.tiny import ensure_tiny_model
    from moe.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(ensure_tiny_model("tiny-qwen3-moe"))
    args = serve.build_parser().parse_args(["--num-prompts", "8", "--random-input-len", "30", "--random-output-len",
                                            "4", "--random-prefix-len", "40", "--random-range-ratio", "0.5"])
    ids = [tok.encode(p) for p, _ in serve.random_requests(args, tok)]
    own = [n for n, _ in serve.sample_lengths(random.Random(0), 8, 30, 4, 0.5)]
    assert [len(x) for x in ids] == [40 + n for n in own]  # as the server will count them
    assert sum(x[:40] == ids[0][:40] for x in ids) >= 7  # the same first 40 (a merge at the seam may differ)
    token_ids = [p for p, _ in serve.random_requests(args)]
    assert [len(p) for p in token_ids] == [40 + n for n in own] and all(p[:40] == token_ids[0][:40] for p in token_ids)


def test_run_latency_times_every_iteration(cache_dir):
    r = latency.run_latency(ENGINE, batch_size=2, input_len=4, output_len=3, num_iters=3, num_iters_warmup=1)
    assert len(r["latencies"]) == 3 and all(t > 0 for t in r["latencies"])
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 3)
    assert list(r["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(r["latencies"]) <= r["percentiles"]["10"] <= r["percentiles"]["99"] <= max(r["latencies"])
    assert r["output_tokens_per_iter"] == [2 * 3] * 3


def test_latency_command_line(cache_dir, capsys):
    out = cache_dir / "lat.json"
    rc = latency.main(["--device", "cpu", "--batch-size", "2", "--input-len", "3", "--output-len", "2",
                       "--num-iters", "2", "--num-iters-warmup", "0", "--output-json", str(out), "--disable-tqdm"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Avg latency: ") and lines[0].endswith(" seconds")
    assert [ln.split("%")[0] for ln in lines[1:]] == ["10", "25", "50", "75", "90", "99"]
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 2 and set(r) >= {"avg_latency", "latencies", "percentiles"}


def test_bad_workload_is_refused_before_the_engine_starts():
    with pytest.raises(ValueError, match="num_iters"):
        latency.run_latency({"model": "/nonexistent"}, 1, 1, 1, num_iters=0, num_iters_warmup=0)
    with pytest.raises(ValueError, match="output_len"):
        throughput.run_throughput({"model": "/nonexistent"}, 1, 0, 1)
