"""`moe bench serve`: an online-serving benchmark against a running OpenAI-compatible server
(`moe serve` or `vllm serve`), with vLLM's `bench serve` flags, so both run the same workload.

Random dataset: --num-prompts prompts of --random-input-len random tokens, each asking for exactly
--random-output-len tokens (ignore_eos). As vLLM's, the prompts are sent as TEXT (so the server
tokenises them) when a tokenizer is at hand: --tokenizer, else --model or the server's model root
(/v1/models) when it is a local folder with tokenizer.json; the text is random tokens decoded and
adjusted until it encodes to exactly the length asked. Without a tokenizer (or with
--prompt-format token-ids) the prompts are random token ids below --vocab-size.
ShareGPT (--dataset-name sharegpt --dataset-path FILE): recorded conversations' first turns as
text, each asking for its answer's token count (or --sharegpt-output-len), chosen by vLLM's rules
(moe/bench/datasets.py); they need the tokenizer.
Requests arrive at --request-rate per second (inf: all at once; else Poisson, or gamma with
--burstiness), at most --max-concurrency in flight. Every request streams, so the client sees
each token's arrival: TTFT (first token), TPOT ((e2e - TTFT) / (output tokens - 1)), ITL (between
chunks) and e2e latency, reported as mean, median and the --metric-percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np

from moe.bench.datasets import DATASETS, check_dataset_args, sharegpt_requests

METRICS = ("ttft", "tpot", "itl", "e2el")
BACKENDS = ("vllm", "openai", "openai-chat")  # vllm and openai: the completions API


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
    p.add_argument("--host", default="127.0.0.1", help="server address (without --base-url)")
    p.add_argument("--port", type=int, default=8000, help="server port (without --base-url)")
    p.add_argument("--backend", default="vllm", choices=BACKENDS,
                   help="the API the requests use: vllm / openai, the completions API (prompt); openai-chat, the "
                        "chat completions API (the prompt as one user message)")
    p.add_argument("--endpoint", default=None, help="the endpoint the requests go to (default: /v1/completions, "
                   "or /v1/chat/completions with --backend openai-chat)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="the server's API key, sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="served model name (default: the server's first model)")
    p.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="the prompts: random tokens, or a ShareGPT file's conversations (--dataset-path)")
    p.add_argument("--dataset-path", default=None, help="the dataset's file (sharegpt: a ShareGPT JSON file)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: tokens to generate per request (default: each answer's length)")
    p.add_argument("--no-oversample", action="store_true",
                   help="sharegpt: send only the conversations that pass, when fewer than --num-prompts")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--random-output-len", type=int, default=128, help="tokens to generate per request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len * (1 - r), len * (1 + r)]")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of one random prefix that begins every prompt, before its --random-input-len own "
                        "(the server's prefix cache reuses it)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated, of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    p.add_argument("--vocab-size", type=int, default=500,
                   help="token-ids prompts are drawn from [1, vocab-size): below every model's vocabulary by default")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json, for text prompts (default: "
                   "--model or the server's model root, when a local folder)")
    p.add_argument("--prompt-format", default="auto", choices=["auto", "text", "token-ids"],
                   help="auto: text when a tokenizer is found, else token ids")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", default=".", help="folder of the --save-result file (made if missing)")
    p.add_argument("--result-filename", default=None,
                   help="name of the --save-result file (default: moe-bench-serve-DATE-TIME.json)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    return p


def resolve_endpoint(args: argparse.Namespace) -> str:
    """The endpoint of --backend, or --endpoint when it is one of that API's."""
    chat = args.backend == "openai-chat"
    if args.endpoint is None:
        return "/v1/chat/completions" if chat else "/v1/completions"
    if chat != args.endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--endpoint {args.endpoint} is not an endpoint of --backend {args.backend}: "
                         + ("the chat API's ends with chat/completions" if chat else
                            "for the chat completions API pass --backend openai-chat"))
    return args.endpoint


def check_range_ratio(range_ratio: float) -> None:
    """--random-range-ratio must lie in [0, 1), as vLLM's."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must lie in [0, 1), got {range_ratio}")


def sample_lengths(rng: random.Random, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float) -> list[tuple[int, int]]:
    """(input length, output length) per request, drawn from `rng` in that order: each uniform
    (inclusive) in [int(len * (1 - r)), int(len * (1 + r))] and at least 1; exactly len when r is 0
    (nothing drawn). The definition of --random-range-ratio of every `moe bench` that has it."""
    check_range_ratio(range_ratio)

    def length(n: int) -> int:
        r = range_ratio
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r else n

    return [(length(input_len), length(output_len)) for _ in range(num_prompts)]


def random_requests(args: argparse.Namespace, tokenizer=None) -> list[tuple[str | list[int], int]]:
    """(prompt, output length) per request, seeded: a text of the drawn token length when a
    tokenizer is given, else token ids."""
    rng = random.Random(args.seed)
    lengths = sample_lengths(rng, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio)
    n_pre = args.random_prefix_len
    if tokenizer is None:
        prefix = [rng.randrange(1, args.vocab_size) for _ in range(n_pre)]
        return [(prefix + [rng.randrange(1, args.vocab_size) for _ in range(n_in)], n_out) for n_in, n_out in lengths]
    pieces = _round_trip_tokens(tokenizer)
    # The prefix as the tokens of one text, so that every prompt starts with the same ones (up to a
    # merge where the prompt's own text begins).
    prefix = tokenizer.encode(_text_of_length(tokenizer, rng, pieces, n_pre)) if n_pre else []
    return [(_text_of_length(tokenizer, rng, pieces, n_pre + n_in, prefix), n_out) for n_in, n_out in lengths]


def dataset_requests(args: argparse.Namespace, tokenizer=None) -> list[tuple[str | list[int], int]]:
    """(prompt, output length) per request of the chosen dataset."""
    if args.dataset_name == "random":
        return random_requests(args, tokenizer)
    if tokenizer is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs the model's tokenizer (to count the prompts' "
                         "tokens): pass --tokenizer FOLDER, and not --prompt-format token-ids")
    return [(r.prompt, r.output_len) for r in sharegpt_requests(
        args.dataset_path, args.num_prompts, tokenizer, args.seed, args.sharegpt_output_len, not args.no_oversample)]


def _round_trip_tokens(tokenizer) -> list[int]:
    """Token ids whose text alone encodes back to them (no special tokens, no partial UTF-8)."""
    backend = tokenizer.backend
    ids = list(range(backend.get_vocab_size(with_added_tokens=False)))
    texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
    encoded = backend.encode_batch(texts, add_special_tokens=False)
    good = [i for i, t, e in zip(ids, texts, encoded) if t and "\ufffd" not in t and e.ids == [i]]
    if not good:
        raise ValueError(f"no token of the tokenizer at {tokenizer.path} encodes back to itself: use "
                         "--prompt-format token-ids")
    return good


def _text_of_length(tokenizer, rng: random.Random, pieces: list[int], n: int, start: list[int] = (),
                    rounds: int = 30) -> str:
    """Random text that the server's tokenizer encodes (as it encodes a prompt) to n tokens, the
    first ones `start`: tokens decoded, re-encoded (neighbours may merge), then cut or topped up at
    the end, until exact."""
    ids = list(start) + [rng.choice(pieces) for _ in range(n - len(start))]
    for _ in range(rounds):
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text)
        if len(got) == n:
            return text
        ids = got[:n] if len(got) > n else got + [rng.choice(pieces) for _ in range(n - len(got))]
    raise ValueError(f"no random text of exactly {n} tokens found in {rounds} rounds")


def find_tokenizer(args: argparse.Namespace, server_root: str | None):
    """The tokenizer text prompts are made with, or None for token-id prompts."""
    from moe.engine.tokenizer import load_tokenizer

    if args.prompt_format == "token-ids":
        return None
    if args.tokenizer is not None:
        tok = load_tokenizer(args.tokenizer) if os.path.exists(args.tokenizer) else None
        if tok is None:
            raise ValueError(f"--tokenizer {args.tokenizer}: no tokenizer.json there")
        return tok
    for folder in (args.model, server_root):
        tok = load_tokenizer(folder) if folder and os.path.isdir(folder) else None
        if tok is not None:
            return tok
    if args.prompt_format == "text" or args.dataset_name != "random":
        what = "--prompt-format text" if args.prompt_format == "text" else f"--dataset-name {args.dataset_name}"
        raise ValueError(f"{what} needs a tokenizer: pass --tokenizer FOLDER")
    print("no tokenizer found (--tokenizer): sending random token ids as the prompts")
    return None


async def _one_request(http, args, model: str, prompt: str | list[int], output_len: int) -> RequestResult:
    res = RequestResult(prompt_len=0 if isinstance(prompt, str) else len(prompt))
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.backend == "openai-chat":  # a chunk's tokens arrive as its choice's delta: counted the same
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
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
                    res.prompt_len = chunk["usage"]["prompt_tokens"]  # as the server counted them
                # Every chunk with a choice carries the step's new tokens, also when they decode to
                # no text yet (a partial character, or ids a dummy model draws outside its tokenizer).
                if not chunk.get("choices"):
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


def _first_model(r, base: str, sent_key: bool) -> dict:
    """The first entry of the server's /v1/models, or a ValueError saying why there is none."""
    if r.status_code == 401:
        what = "refused the API key sent" if sent_key else "needs an API key"
        raise ValueError(f"the server at {base} {what} (HTTP 401 on /v1/models): pass the server's key "
                         "with --api-key KEY or in $OPENAI_API_KEY")
    try:
        return r.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"the server at {base} answered /v1/models with HTTP {r.status_code} and no model: "
                         f"{r.text[:200]!r}") from None


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
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=args.timeout, limits=limits) as http:
        served = _first_model(await http.get("/v1/models"), base, bool(args.api_key))
        model = args.model or served["id"]
        tokenizer = find_tokenizer(args, served.get("root"))
        if tokenizer is None and args.backend == "openai-chat":
            raise ValueError("--backend openai-chat sends text messages: it needs a tokenizer (--tokenizer FOLDER), "
                             "not token-id prompts")
        requests = dataset_requests(args, tokenizer)
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
    summary = summarize(args, model, results, duration)
    summary["prompt_format"] = "token-ids" if tokenizer is None else "text"
    summary["dataset_name"] = args.dataset_name
    summary["backend"], summary["endpoint"] = args.backend, args.endpoint
    return summary


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


def _raise_open_files_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # httpx logs every request at INFO (the `moe` command logs INFO): hundreds of lines of noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.num_prompts < 1 or args.random_input_len < 1 or args.random_output_len < 1 or args.random_prefix_len < 0:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1, "
                         "--random-prefix-len >= 0")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        raise ValueError("--request-rate must be > 0 and --max-concurrency >= 1")
    check_range_ratio(args.random_range_ratio)
    check_dataset_args(args.dataset_name, args.dataset_path)
    args.endpoint = resolve_endpoint(args)
    _raise_open_files_limit()  # one connection per request in flight
    if args.save_result:  # made (or refused) now, not after the run
        os.makedirs(args.result_dir, exist_ok=True)
    summary = asyncio.run(run_benchmark(args))
    print_summary(summary)
    if args.save_result:
        name = args.result_filename or f"moe-bench-serve-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"results written to {path}")
    return 0 if summary["failed"] == 0 else 1
