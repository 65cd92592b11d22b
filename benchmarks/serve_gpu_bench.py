"""Serving against offline throughput on one GPU: the same random workload through `LLM.generate`
and through `moe serve` (with 1 and with 4 API processes) driven by `moe bench serve` at
--request-rate inf (every request at once: the server saturated). With --request-rates (e.g.
4,8,16,inf): serving under Poisson load instead, one `moe serve` (per --api-server-counts, default
1) driven once per rate, no offline phase.

    python benchmarks/serve_gpu_bench.py .gpu_ckpts/qwen3_30b_a3b --out-dir gpu_out/serve
    python benchmarks/serve_gpu_bench.py .gpu_ckpts/qwen3_30b_a3b --out-dir gpu_out/serve_poisson \\
        --request-rates 4,8,16,inf --num-prompts 400 --random-range-ratio 0.75
    python benchmarks/serve_gpu_bench.py tiny-qwen3-moe --out-dir /tmp/sb --num-prompts 16 \\
        --input-len 16 --output-len 8 --engine-args "--device cpu --max-model-len 256"   # a CPU dry run

The prompts are TEXT of --input-len tokens (moe.bench.serve.random_requests; each request's input
and output length drawn in [len * (1 - r), len * (1 + r)] with --random-range-ratio r, exactly len
by default), so the API processes tokenise them: that is the work --api-server-count spreads. The
offline run and every server of the inf mode use --seed; a warm-up before a timed run (256
requests of 8 tokens) uses other prompts (--seed + 1000), and the rates of --request-rates, on one
server, use --seed + i for the i-th rate: no timed prompt is in the prefix cache from an earlier
run (the totals of the rows differ a little: the lengths are drawn anew, from the same ranges).
With --dataset-path FILE (a ShareGPT JSON file) the requests are its conversations instead, chosen as
`moe bench serve --dataset-name sharegpt` chooses them, each generating its answer's token count.
A checkpoint folder without tokenizer.json (a config-only dummy) gets the built-in tiny model's
tokenizer (--tokenizer overrides; the summary records which). Every phase runs in a process of
its own (the GPU is free between them), bounded by a timeout and by --deadline-s for the whole
run; servers listen on 127.0.0.1 and are stopped (SIGTERM, then SIGKILL of their process group)
in finally blocks.

Writes to --out-dir: offline.json, serve_api{N}.json (moe bench serve's result), a log per phase,
and summary.json: per configuration request throughput, output tok/s, TTFT / TPOT / ITL mean,
median and p99, and output tok/s over the offline run's. With --request-rates: poisson_api{N}_
rate{R}.json per rate (and _warmup.json), and summary.json with per configuration and rate the
request throughput, output tok/s, and TTFT / TPOT / ITL / E2E latency mean, p50, p90 and p99.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's packages, not an installed copy
    sys.path.insert(0, ROOT)
GPU_ENGINE_ARGS = "--load-format dummy --max-model-len 4096 --max-num-seqs 256 --max-num-batched-tokens 8192"
LATENCIES = ("ttft", "tpot", "itl")
RATE_LATENCIES = ("ttft", "tpot", "itl", "e2el")
RATE_STATS = ("mean", "p50", "p90", "p99")
WARMUP_SEED = 1000   # the warm-up's prompts: --seed + this, none of a timed run's
WARMUP_PROMPTS, WARMUP_TOKENS = 256, 8


class Deadline:
    """Seconds left of the whole run; each phase's timeout is cut to it."""

    def __init__(self, total_s: float) -> None:
        self.end = time.monotonic() + total_s

    def cap(self, want_s: float) -> float:
        left = self.end - time.monotonic()
        if left < 5:
            raise TimeoutError("the run's --deadline-s is spent")
        return min(want_s, left)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_tokenizer(checkpoint: str, tokenizer: str | None) -> str:
    if tokenizer is not None:
        return tokenizer
    if os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        return checkpoint
    from models.tiny import ensure_tiny_model

    return ensure_tiny_model("tiny-qwen3-moe")


def workload_args(args: argparse.Namespace, seed: int | None = None, num_prompts: int | None = None,
                  output_len: int | None = None) -> list[str]:
    """The workload in moe bench serve's flags (the offline phase parses the same); seed,
    num_prompts and output_len override the command line's (with --dataset-path, output_len fixes the
    conversations' output lengths; None: each answer's)."""
    if args.dataset_path:
        return ["--dataset-name", "sharegpt", "--dataset-path", os.path.abspath(args.dataset_path),
                "--num-prompts", str(num_prompts or args.num_prompts),
                "--seed", str(args.seed if seed is None else seed),
                *(["--sharegpt-output-len", str(output_len)] if output_len else [])]
    return ["--num-prompts", str(num_prompts or args.num_prompts), "--random-input-len", str(args.input_len),
            "--random-output-len", str(output_len or args.output_len),
            "--random-range-ratio", str(args.random_range_ratio), "--seed", str(args.seed if seed is None else seed)]


def warmup_args(args: argparse.Namespace) -> list[str]:
    """A warm-up's workload: short requests of the same input lengths, on prompts of their own."""
    return workload_args(args, seed=args.seed + WARMUP_SEED, num_prompts=min(args.num_prompts, WARMUP_PROMPTS),
                         output_len=WARMUP_TOKENS)


def parse_rates(text: str) -> list[float]:
    """'4,8,16,inf' -> [4.0, 8.0, 16.0, inf]: requests per second, each > 0."""
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"need a comma-separated list of rates > 0 (or inf), got {text!r}")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---- offline: LLM.generate in a child process -----------------------------------------------
def offline_worker(argv: list[str]) -> int:
    """`serve_gpu_bench.py offline-worker OUT_JSON TOKENIZER [workload flags] -- MODEL [engine flags]`."""
    from moe import LLM, SamplingParams
    from moe.bench.engine_workload import add_engine_args, engine_kwargs_from_args
    from moe.bench.serve import build_parser as bench_parser, dataset_requests
    from moe.engine.tokenizer import Tokenizer

    split = argv.index("--")
    out_json, tokenizer_dir, workload = argv[0], argv[1], argv[2:split]
    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    engine_cli = argv[split + 1:]
    kwargs = engine_kwargs_from_args(engine_parser.parse_args(["--model", engine_cli[0], *engine_cli[1:]]))
    tokenizer = Tokenizer(tokenizer_dir)
    requests = dataset_requests(bench_parser().parse_args(workload), tokenizer)
    warm_args = bench_parser().parse_args(workload)
    warm_args.seed += WARMUP_SEED  # prompts of their own: none of the timed run's in the prefix cache
    warm_args.num_prompts = min(warm_args.num_prompts, WARMUP_PROMPTS)
    warmup = [p for p, _ in dataset_requests(warm_args, tokenizer)]
    t0 = time.perf_counter()
    llm = LLM(kwargs.pop("model"), **kwargs)
    start_s = time.perf_counter() - t0
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True) for _, n_out in requests]
        # Warm-up on other prompts of the same lengths: the Triton kernels compile (into the on-disk
        # cache the servers started later also read) outside the timed run.
        llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True),
                     use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    result = {"elapsed_s": elapsed, "start_s": start_s, "num_requests": len(outs), "total_prompt_tokens": prompt_tokens,
              "total_output_tokens": generated, "request_throughput": len(outs) / elapsed,
              "output_throughput": generated / elapsed, "total_token_throughput": (generated + prompt_tokens) / elapsed}
    with open(out_json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result), flush=True)
    return 0


def run_offline(args, engine_cli: list[str], tokenizer: str, deadline: Deadline) -> dict:
    out_json = os.path.join(args.out_dir, "offline.json")
    log = os.path.join(args.out_dir, "offline.log")
    cmd = [sys.executable, os.path.abspath(__file__), "offline-worker", out_json, tokenizer, *workload_args(args),
           "--", args.checkpoint, *engine_cli]
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=deadline.cap(args.phase_timeout_s)).returncode
        except subprocess.TimeoutExpired:  # subprocess.run kills the child
            raise RuntimeError(f"offline run timed out: {_tail(log)}") from None
    if rc != 0:
        raise RuntimeError(f"offline run failed ({rc}): {_tail(log)}")
    with open(out_json) as f:
        return {**json.load(f), "wall_s": time.monotonic() - t0}


# ---- serving: moe serve + moe bench serve ---------------------------------------------------
class Server:
    """`moe serve` on 127.0.0.1 in a session of its own (so every process it starts can be killed)."""

    def __init__(self, checkpoint: str, api_servers: int, engine_cli: list[str], log_path: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe.entrypoints.cli", "serve", checkpoint, "--host", "127.0.0.1",
             "--port", str(self.port), "--api-server-count", str(api_servers), "--uvicorn-log-level", "warning",
             *engine_cli],
            cwd=ROOT, env=_env(), stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> float:
        import httpx

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moe serve exited with {self.proc.returncode}: {_tail(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"moe serve not healthy within {timeout_s:.0f} s: {_tail(self.log_path)}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM (the server drains, then stops its engine core), then SIGKILL of whatever of its
        process group is left."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its session's group: the cores and API processes
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(10)
        finally:
            self.log.close()


def bench_serve(args, server: Server, name: str, tokenizer: str, deadline: Deadline, workload: list[str],
                rate: float = float("inf"), percentiles: str = "50,99", timeout_s: float | None = None) -> dict:
    """One `moe bench serve` run against a running server: its result (written as NAME.json),
    with its exit status as bench_rc; NAME_bench.log holds its output."""
    bench_log = os.path.join(args.out_dir, f"{name}_bench.log")
    result_path = os.path.join(args.out_dir, f"{name}.json")
    if os.path.exists(result_path):
        os.remove(result_path)  # an earlier run's must not pass for this one's
    cmd = [sys.executable, "-m", "moe.entrypoints.cli", "bench", "serve", "--base-url", server.url,
           "--tokenizer", tokenizer, "--prompt-format", "text", *workload, "--request-rate", rate_label(rate),
           "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", percentiles,
           "--timeout", str(args.phase_timeout_s), "--save-result", "--result-dir", args.out_dir,
           "--result-filename", f"{name}.json"]
    with open(bench_log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=deadline.cap(timeout_s or args.phase_timeout_s)).returncode
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"moe bench serve timed out: {_tail(bench_log)}") from None
    if not os.path.isfile(result_path):
        raise RuntimeError(f"moe bench serve wrote no result ({rc}): {_tail(bench_log)}")
    with open(result_path) as f:
        return {**json.load(f), "bench_rc": rc}


def run_serving(args, api_servers: int, engine_cli: list[str], tokenizer: str, deadline: Deadline) -> dict:
    name = f"serve_api{api_servers}"
    t0 = time.monotonic()
    server = Server(args.checkpoint, api_servers, engine_cli, os.path.join(args.out_dir, f"{name}_server.log"))
    try:
        startup_s = server.wait_healthy(deadline.cap(args.startup_timeout_s))
        result = bench_serve(args, server, name, tokenizer, deadline, workload_args(args))
    finally:
        server.stop()
    return {**result, "startup_s": startup_s, "wall_s": time.monotonic() - t0}


def run_rates(args, api_servers: int, engine_cli: list[str], tokenizer: str, deadline: Deadline) -> dict:
    """One server under each of --request-rates in turn (Poisson arrivals; inf: all at once),
    after an untimed warm-up; a rate that fails is recorded and the next one runs."""
    name = f"poisson_api{api_servers}"
    t0 = time.monotonic()
    server = Server(args.checkpoint, api_servers, engine_cli, os.path.join(args.out_dir, f"{name}_server.log"))
    rows: dict[str, dict] = {}
    try:
        startup_s = server.wait_healthy(deadline.cap(args.startup_timeout_s))
        t = time.monotonic()
        warm = bench_serve(args, server, f"{name}_warmup", tokenizer, deadline, warmup_args(args))
        warmup = {"completed": warm["completed"], "failed": warm["failed"], "wall_s": time.monotonic() - t}
        print(f"api_servers_{api_servers}: server up in {startup_s:.1f} s, warm-up {warmup['wall_s']:.1f} s",
              flush=True)
        for i, rate in enumerate(args.request_rates):
            label, seed = rate_label(rate), args.seed + i
            arrivals_s = 0.0 if math.isinf(rate) else args.num_prompts / rate
            try:
                result = bench_serve(args, server, f"{name}_rate{label}", tokenizer, deadline,
                                     workload_args(args, seed=seed), rate, "50,90,99",
                                     timeout_s=args.phase_timeout_s + arrivals_s)
                rows[label] = summarize_rate(result, label, seed)
                print(f"api_servers_{api_servers} rate {label}: {result['request_throughput']:.2f} req/s, "
                      f"{result['output_throughput']:.1f} output tok/s, TTFT p50 {result['p50_ttft_ms']:.1f} ms, "
                      f"TPOT p50 {result['p50_tpot_ms']:.1f} ms, {result['failed']} failed", flush=True)
            except (RuntimeError, TimeoutError) as e:
                rows[label] = {"request_rate": label, "seed": seed, "error": str(e)}
                print(f"api_servers_{api_servers} rate {label} failed: {e}", flush=True)
    finally:
        server.stop()
    return {"startup_s": startup_s, "warmup": warmup, "rates": rows, "wall_s": time.monotonic() - t0}


# ---- summary ----------------------------------------------------------------------------------
def summarize_config(result: dict, offline_tok_s: float | None) -> dict:
    row = {k: result.get(k) for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                                      "total_input_tokens", "total_output_tokens", "prompt_format", "startup_s")}
    for m in LATENCIES:
        for stat in ("mean", "median", "p99"):
            row[f"{stat}_{m}_ms"] = result.get(f"{stat}_{m}_ms")
    row["serving_vs_offline"] = result["output_throughput"] / offline_tok_s if offline_tok_s else None
    return row


def summarize_rate(result: dict, label: str, seed: int) -> dict:
    row = {"request_rate": label, "seed": seed}
    row.update({k: result.get(k) for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                                           "total_token_throughput", "total_input_tokens", "total_output_tokens",
                                           "prompt_format")})
    for m in RATE_LATENCIES:
        for stat in RATE_STATS:
            row[f"{stat}_{m}_ms"] = result.get(f"{stat}_{m}_ms")
    return row


def print_rates_table(summary: dict) -> None:
    cols = [("config", 16), ("rate", 5), ("req/s", 7), ("out tok/s", 9)] + \
        [(f"{m} {s}", 10) for m in LATENCIES for s in RATE_STATS]
    print(" ".join(f"{c:>{w}}" for c, w in cols))
    for name, config in summary["configs"].items():
        if "error" in config:
            print(f"{name:>16} error: {config['error'][:200]}")
            continue
        for label, row in config["rates"].items():
            if "error" in row:
                print(f"{name:>16} {label:>5} error: {row['error'][:200]}")
                continue
            cells = [f"{name:>16}", f"{label:>5}", f"{row['request_throughput']:>7.2f}",
                     f"{row['output_throughput']:>9.1f}"]
            cells += [f"{row[f'{s}_{m}_ms']:>10.1f}" for m in LATENCIES for s in RATE_STATS]
            print(" ".join(cells))
    print("(latencies in ms; E2E latency and the per-rate seeds in summary.json)")


def print_table(summary: dict) -> None:
    cols = [("config", 12), ("req/s", 8), ("out tok/s", 10), ("vs offl", 8)] + \
        [(f"{m} {s}", 11) for m in LATENCIES for s in ("mean", "med", "p99")]
    print(" ".join(f"{c:>{w}}" for c, w in cols))
    off = summary.get("offline")
    if off:
        print(" ".join([f"{'offline':>12}", f"{off['request_throughput']:>8.2f}", f"{off['output_throughput']:>10.1f}",
                        f"{1.0:>8.3f}"]))
    for name, row in summary["configs"].items():
        if "error" in row:
            print(f"{name:>12} error: {row['error'][:200]}")
            continue
        ratio = row["serving_vs_offline"]
        cells = [f"{name:>12}", f"{row['request_throughput']:>8.2f}", f"{row['output_throughput']:>10.1f}",
                 f"{ratio:>8.3f}" if ratio is not None else f"{'-':>8}"]
        cells += [f"{row[f'{s}_{m}_ms']:>11.1f}" for m in LATENCIES for s in ("mean", "median", "p99")]
        print(" ".join(cells))
    print("(latencies in ms)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["offline-worker"]:
        return offline_worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint folder (or tiny-qwen3-moe)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="each request's input and output length drawn in [len * (1 - r), len * (1 + r)], r in [0, 1)")
    p.add_argument("--dataset-path", default=None,
                   help="a ShareGPT JSON file: its conversations instead of random prompts, each generating its "
                        "answer's length (moe bench serve --dataset-name sharegpt; --input-len, --output-len and "
                        "--random-range-ratio do not apply; warm-ups take other conversations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-server-counts", type=int, nargs="+", default=None,
                   help="API processes of each server configuration (default: 1 and 4; 1 with --request-rates)")
    p.add_argument("--request-rates", type=parse_rates, default=None,
                   help="e.g. 4,8,16,inf: one server per configuration, `moe bench serve` at each rate in turn "
                        "(Poisson arrivals), latency percentiles 50,90,99; no offline phase")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the checkpoint's, "
                   "else the built-in tiny model's)")
    p.add_argument("--engine-args", default=GPU_ENGINE_ARGS, help="engine flags of both the offline run and "
                   "moe serve (default: %(default)s)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--phase-timeout-s", type=float, default=300.0,
                   help="bound of each offline / bench run (under --request-rates: plus num-prompts / rate)")
    p.add_argument("--deadline-s", type=float, default=570.0, help="bound of the whole run")
    args = p.parse_args(argv)
    if args.api_server_counts is None:
        args.api_server_counts = [1] if args.request_rates else [1, 4]
    if min(args.num_prompts, args.input_len, args.output_len, *args.api_server_counts) < 1:
        raise ValueError("--num-prompts, --input-len, --output-len and --api-server-counts must be >= 1")
    from moe.bench.serve import check_range_ratio

    check_range_ratio(args.random_range_ratio)
    os.makedirs(args.out_dir, exist_ok=True)
    # A `timeout` around this script sends SIGTERM: unwind, so that the finally blocks stop the server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from moe.bench.serve import _raise_open_files_limit

    _raise_open_files_limit()  # inherited by the servers: a connection per request, all at once
    deadline = Deadline(args.deadline_s)
    tokenizer = pick_tokenizer(args.checkpoint, args.tokenizer)
    engine_cli = [*shlex.split(args.engine_args), "--tokenizer", tokenizer]
    summary: dict = {"checkpoint": args.checkpoint, "tokenizer": tokenizer, "engine_args": engine_cli,
                     "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                  "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
                                  "seed": args.seed, "request_rate": "inf", "prompts": "text",
                                  "dataset_path": args.dataset_path},
                     "offline": None, "configs": {}}
    if args.request_rates:
        return run_rates_mode(args, summary, engine_cli, tokenizer, deadline)
    failed = False
    try:
        if not args.skip_offline:
            try:
                summary["offline"] = run_offline(args, engine_cli, tokenizer, deadline)
                print(f"offline: {summary['offline']['output_throughput']:.1f} output tok/s in "
                      f"{summary['offline']['elapsed_s']:.2f} s", flush=True)
            except (RuntimeError, TimeoutError) as e:
                summary["offline_error"], failed = str(e), True
                print(f"offline failed: {e}", flush=True)
        offline_tok_s = summary["offline"]["output_throughput"] if summary["offline"] else None
        for count in args.api_server_counts:
            name = f"api_servers_{count}"
            try:
                result = run_serving(args, count, engine_cli, tokenizer, deadline)
                summary["configs"][name] = summarize_config(result, offline_tok_s)
                failed |= result["failed"] > 0 or result.get("prompt_format") != "text"
                print(f"{name}: {result['output_throughput']:.1f} output tok/s, {result['completed']} completed, "
                      f"{result['failed']} failed (server up in {result['startup_s']:.1f} s)", flush=True)
            except (RuntimeError, TimeoutError) as e:
                summary["configs"][name], failed = {"error": str(e)}, True
                print(f"{name} failed: {e}", flush=True)
    finally:
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print_table(summary)
    return 1 if failed else 0


def run_rates_mode(args, summary: dict, engine_cli: list[str], tokenizer: str, deadline: Deadline) -> int:
    """--request-rates: per --api-server-counts, one server and every rate (run_rates)."""
    labels = [rate_label(r) for r in args.request_rates]
    summary["workload"].update(request_rate=None, request_rates=labels, percentiles=[50, 90, 99],
                               seeds={label: args.seed + i for i, label in enumerate(labels)},
                               warmup={"num_prompts": min(args.num_prompts, WARMUP_PROMPTS),
                                       "output_len": WARMUP_TOKENS, "seed": args.seed + WARMUP_SEED})
    failed = False
    try:
        for count in args.api_server_counts:
            name = f"api_servers_{count}"
            try:
                summary["configs"][name] = config = run_rates(args, count, engine_cli, tokenizer, deadline)
                failed |= any("error" in row or row["failed"] > 0 or row.get("prompt_format") != "text"
                              for row in config["rates"].values())
            except (RuntimeError, TimeoutError) as e:
                summary["configs"][name], failed = {"error": str(e)}, True
                print(f"{name} failed: {e}", flush=True)
    finally:
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print_rates_table(summary)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
