"""`moe bench serve`: an online-serving benchmark against a running OpenAI-compatible server
(`moe serve` or `vllm serve`), with vLLM's `bench serve` flags, so both run the same workload.

Random dataset: --num-prompts prompts of --random-input-len random token ids (sent as token ids,
so no tokenizer is needed here), each asking for exactly --random-output-len tokens (ignore_eos).
Requests arrive at --request-rate per second (inf: all at once; else Poisson, or gamma with
--burstiness), at most --max-concurrency in flight. Every request streams, so the client sees
each token's arrival: TTFT (first token), TPOT ((e2e - TTFT) / (output tokens - 1)), ITL (between
chunks) and e2e latency, reported as mean, median and the --metric-percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated, of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=500,
                   help="prompt token ids are drawn from [1, vocab-size): below every model's vocabulary by default")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    return p


def random_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, seeded."""
    rng = random.Random(args.seed)
    vocab = args.vocab_size

    def length(n: int) -> int:
        r = args.random_range_ratio
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r else n

    return [([rng.randrange(1, vocab) for _ in range(length(args.random_input_len))], length(args.random_output_len))
            for _ in range(args.num_prompts)]


async def _one_request(http, args, model: str, prompt: list[int], output_len: int) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    try:
        async with http.stream("POST", args.endpoint, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2el = time.perf_counter() - start
        res.ok = True
    except Exception as exc:  # a failed request is counted, not fatal
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            # gamma with shape k and mean 1/rate (k=1: exponential gaps, a Poisson process)
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def run_benchmark(args: argparse.Namespace) -> dict:
    import httpx
    from tqdm.auto import tqdm

    base = args.base_url or f"http://{args.host}:{args.port}"
    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        requests = random_requests(args)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")

        async def limited(prompt, output_len):
            if sem is None:
                res = await _one_request(http, args, model, prompt, output_len)
            else:
                async with sem:
                    res = await _one_request(http, args, model, prompt, output_len)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed)):
            tasks.append(asyncio.create_task(limited(*requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(args, model, results, duration)


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "model_id": model, "num_prompts": len(results), "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency, "duration": duration, "completed": len(ok),
        "failed": len(results) - len(ok), "errors": sorted({r.error for r in results if r.error})[:5],
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
    }
    values = {"ttft": [r.ttft for r in ok], "e2el": [r.e2el for r in ok],
              "tpot": [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl]}
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
    for name in [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]:
        if name not in METRICS:
            raise ValueError(f"--percentile-metrics: unknown metric {name!r}; choose from {', '.join(METRICS)}")
        v = np.array(values[name] or [0.0]) * 1000.0  # milliseconds, as vLLM reports them
        summary[f"mean_{name}_ms"] = float(v.mean())
        summary[f"median_{name}_ms"] = float(np.median(v))
        summary[f"std_{name}_ms"] = float(v.std())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p))
    return summary


def print_summary(s: dict) -> None:
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    for k, v in s.items():
        if k.endswith("_ms"):
            rows.append((k.replace("_ms", "").replace("_", " ").upper().replace("MEDIAN", "Median")
                         .replace("MEAN", "Mean").replace("STD", "Std") + " (ms):", f"{v:.2f}"))
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for e in s["errors"]:
        print(f"error: {e}")
    print("=" * 50)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--request-rate must be > 0 and --max-concurrency >= 1")
    summary = asyncio.run(run_benchmark(args))
    print_summary(summary)
    if args.save_result:
        name = args.result_filename or f"moe-bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"results written to {path}")
    return 0 if summary["failed"] == 0 else 1
