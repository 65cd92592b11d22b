"""A bounded soak of `moe serve` on loopback: a fixed number of requests from concurrent clients, a
seeded mix of completions and chat, streaming and not, n > 1, several prompts in one request, stop
strings and token ids, max_tokens edge cases (1, exactly what the context leaves, min_tokens), clients
that hang up mid-stream or before the answer, and bad requests. In two halves, then SIGTERM.

Checked: every good request got a whole, well-formed answer (a stream's events parse, each choice
finishes once, the stream ends with [DONE]); every bad one a JSON 400; /health answered 200 throughout,
each probe within HEALTH_BOUND_S; the server's memory (the RSS of its processes) grew by less than
RSS_GROWTH_BOUND between the end of the first half and the end of the second; nothing left running
afterwards (/metrics: no request running or waiting, the KV cache empty; every good sequence counted as
finished); no traceback in the log; after SIGTERM the server exits with status 0, all its processes end,
and nothing of theirs stays in /tmp or /dev/shm.

Sized for a 2-core machine (about 30 s with the tiny model); the bounds are generous: they catch a
leak, a stuck event loop or a request that never ends, not a slow machine."""
from __future__ import annotations

import json
import os
import random
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moe.entrypoints.serve import protocol
from tests.serve.helpers import ENGINE_ARGS, MODEL_NAME, ServerProcess, headers, process_tree, scrape_metrics, \
    wait_until_idle

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")

NUM_REQUESTS = 384        # in two halves
CLIENTS = 8               # concurrent client threads
HEALTH_PERIOD_S = 0.25
HEALTH_BOUND_S = 3.0      # each /health probe, under the load (seen: 26 ms, 0.8 s with the machine shared)
RSS_GROWTH_BOUND = 64 << 20  # bytes, over the second half
MAX_MODEL_LEN = ENGINE_ARGS["max_model_len"]
# One stop string per request: with several, the first of the list found in a token's text wins (as in
# vLLM), even when another one comes earlier in that text (" there": "e" before " t").
STOP_STRINGS = ["e", " t", "o", "!"]


def _prompt(rng: random.Random) -> str:
    words = ["Hello", "there", "experts", "route", "tokens", "the", "cache", "blocks", "fox", "東京", "😀"]
    return " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))


KINDS = ["completion", "completion", "chat", "chat", "n", "prompts", "stop", "stop_ids", "edge", "hang_up", "bad",
         "bad"]
EDGES = ["one", "fill", "min_tokens", "default"]  # "default": no max_tokens
BADS = ["n", "temperature", "context", "greedy_n", "json", "no_prompt", "logprobs", "type"]


def plan(num: int, seed: int = 0) -> list[dict]:
    """The soak's requests, seeded: each kind about as often as KINDS lists it, the variants of the
    edge cases and of the bad requests in turn, so that every one of them comes up."""
    rng = random.Random(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(num)]
    rng.shuffle(kinds)
    turns = {"edge": 0, "bad": 0}
    specs = []
    for i, kind in enumerate(kinds):
        variant = None
        if kind in turns:
            variant = (EDGES if kind == "edge" else BADS)[turns[kind] % len(EDGES if kind == "edge" else BADS)]
            turns[kind] += 1
        specs.append(_request(i, kind, variant, rng))
    return specs


def _request(i: int, kind: str, variant: str | None, rng: random.Random) -> dict:
    """One request of the soak: endpoint, body (or raw bytes), what to expect and how to check it."""
    stream = rng.random() < 0.5
    chat = rng.random() < 0.5
    body = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0.0, 0.8]),
            "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    spec = {"i": i, "kind": kind, "chat": chat, "stream": stream, "expect": "ok", "n": 1, "prompts": 1,
            "exact_tokens": None}
    if kind == "n":
        body.update(n=rng.randint(2, 4), temperature=1.0, ignore_eos=True)
        spec["n"], spec["exact_tokens"] = body["n"], body["max_tokens"]
    elif kind == "prompts":  # several prompts in one completion request: choice p * n + j
        chat = spec["chat"] = False
        body.pop("messages", None)
        body["prompt"] = [[rng.randrange(1, 500) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(2, 3))]
        body.update(n=2, temperature=1.0, ignore_eos=True)
        spec.update(n=2, prompts=len(body["prompt"]), exact_tokens=body["max_tokens"])
    elif kind == "stop":
        stop = rng.choice(STOP_STRINGS)
        body.update(stop=rng.choice([stop, [stop]]), max_tokens=rng.randint(4, 24), temperature=1.0,
                    include_stop_str_in_output=rng.random() < 0.5)
        spec["stop"], spec["stop_string"] = body["include_stop_str_in_output"], stop
    elif kind == "stop_ids":
        body.update(stop_token_ids=[rng.randrange(1, 500) for _ in range(40)], max_tokens=24, temperature=1.0)
        spec["stop_ids"] = body["stop_token_ids"]
    elif kind == "edge":
        edge = variant
        body["ignore_eos"] = True
        if edge == "one":
            body["max_tokens"] = 1
        elif edge == "fill":  # exactly what the context leaves after a token-id prompt
            chat = spec["chat"] = False
            body.pop("messages", None)
            length = rng.randint(MAX_MODEL_LEN - 24, MAX_MODEL_LEN - 1)
            body.update(prompt=[rng.randrange(1, 500) for _ in range(length)], max_tokens=MAX_MODEL_LEN - length)
        elif edge == "min_tokens":
            body.update(min_tokens=body["max_tokens"], ignore_eos=False)
        elif chat:  # max_completion_tokens, chat's newer name for max_tokens
            body["max_completion_tokens"] = body.pop("max_tokens")
        else:  # no max_tokens: 16 for completions (the EOS may end it first). Not for chat: what fits in the
            del body["max_tokens"]  # context, 200+ tokens, would make the soak's time one request's
            body["ignore_eos"] = False
        spec["exact_tokens"] = body.get("max_tokens", body.get("max_completion_tokens"))
    elif kind == "hang_up":  # a long answer the client stops reading (stream) or waiting for
        body.update(max_tokens=200, ignore_eos=True, temperature=0.0)
        if chat:
            body["messages"] = [{"role": "user", "content": "Hi"}]
        else:
            body["prompt"] = "Hi"
        spec["expect"] = "hang_up"
    elif kind == "bad":
        bad = variant
        spec["expect"], spec["bad"] = "bad", bad
        if bad == "n":
            body.update(n=protocol.DEFAULT_MAX_N + 1, temperature=1.0)
        elif bad == "temperature":
            body["temperature"] = -1.0
        elif bad == "context":
            body["max_tokens"] = MAX_MODEL_LEN + 1
        elif bad == "greedy_n":
            body.update(n=2, temperature=0.0)
        elif bad == "json":
            spec["raw"] = b'{"model": "' + MODEL_NAME.encode() + b'", "prompt": "Hi", "max_tokens": 2,,}'
        elif bad == "no_prompt":
            body.pop("prompt", None)
            body.pop("messages", None)
        elif bad == "logprobs":
            body["logprobs"] = 1000 if not chat else True
            if chat:
                body["top_logprobs"] = 1000
        else:
            body["max_tokens"] = "3"  # strict types: a string is no integer
    if stream and spec["expect"] != "bad":
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    spec["body"] = body
    spec["url"] = "/v1/chat/completions" if chat else "/v1/completions"
    return spec


def _text(choice: dict, chat: bool) -> str:
    return (choice["message"]["content"] or "") if chat else choice["text"]


def _check_choices(spec: dict, choices: list[dict], completion_tokens: int) -> None:
    want = spec["n"] * spec["prompts"]
    assert sorted(c["index"] for c in choices) == list(range(want)), spec
    for c in choices:
        assert c["finish_reason"] in ("stop", "length"), (spec, c)
        text = _text(c, spec["chat"])
        assert isinstance(text, str)
        if "stop" in spec:
            stop = spec["stop_string"]
            if c["finish_reason"] == "stop" and isinstance(c["stop_reason"], str):
                assert c["stop_reason"] == stop, (spec, c)
                assert text.endswith(stop) == spec["stop"], (spec, c)
                text = text[:-len(stop)] if spec["stop"] else text
            assert stop not in text, (spec, c)  # the text ends at its first occurrence
        if "stop_ids" in spec and c["finish_reason"] == "stop" and c["stop_reason"] is not None:
            assert c["stop_reason"] in spec["stop_ids"], (spec, c)
    if spec["exact_tokens"] is not None:
        assert completion_tokens == want * spec["exact_tokens"], spec
        assert all(c["finish_reason"] == "length" for c in choices), spec
    else:
        assert 1 <= completion_tokens <= want * MAX_MODEL_LEN


def _check_stream(spec: dict, lines: list[str]) -> None:
    assert lines and all(line.startswith("data: ") for line in lines), (spec, lines[:3])
    events = [line[len("data: "):] for line in lines]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, (spec, events[-3:])
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), (spec, chunks[-1])
    usage = chunks[-1]["usage"]  # include_usage: the last chunk, without choices
    assert chunks[-1]["choices"] == [] and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    merged: dict[int, dict] = {}
    for chunk in chunks[:-1]:
        assert chunk["object"] == ("chat.completion.chunk" if spec["chat"] else "text_completion"), chunk
        for c in chunk["choices"]:
            m = merged.setdefault(c["index"], {"index": c["index"], "text": "", "message": {"content": ""},
                                               "finish_reason": None, "stop_reason": None})
            assert m["finish_reason"] is None, (spec, "a choice went on after it finished")
            piece = (c["delta"].get("content") or "") if spec["chat"] else c["text"]
            m["text"] += piece
            m["message"]["content"] += piece
            if c.get("finish_reason") is not None:
                m["finish_reason"], m["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    _check_choices(spec, list(merged.values()), usage["completion_tokens"])


def _run(client: httpx.Client, url: str, spec: dict) -> str:
    """Send one request and check its answer; returns what it was ("ok", "bad", "hung_up")."""
    target = url + spec["url"]
    if spec["expect"] == "bad":
        if "raw" in spec:
            r = client.post(target, content=spec["raw"], headers={**headers(), "content-type": "application/json"})
        else:
            r = client.post(target, json=spec["body"])
        assert r.status_code == 400, (spec, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] and error["message"], (spec, error)
        return "bad"
    if spec["expect"] == "hang_up":
        if spec["stream"]:
            with client.stream("POST", target, json=spec["body"]) as r:
                assert r.status_code == 200
                seen = 0
                for line in r.iter_lines():
                    seen += line.startswith("data: ")
                    if seen == 2:
                        break  # leaving the block closes the connection mid-stream
            assert seen == 2
        else:
            try:
                client.post(target, json=spec["body"], timeout=0.5)
            except httpx.TimeoutException:
                pass  # gone before the answer: the server aborts the request
        return "hung_up"
    if spec["stream"]:
        with client.stream("POST", target, json=spec["body"]) as r:
            assert r.status_code == 200, (spec, r.read())
            assert r.headers["content-type"].startswith("text/event-stream")
            _check_stream(spec, [line for line in r.iter_lines() if line])
    else:
        r = client.post(target, json=spec["body"])
        assert r.status_code == 200, (spec, r.text)
        out = r.json()
        assert out["object"] == ("chat.completion" if spec["chat"] else "text_completion")
        if spec["chat"]:
            assert all(c["message"]["role"] == "assistant" for c in out["choices"])
        usage = out["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        _check_choices(spec, out["choices"], usage["completion_tokens"])
    return "ok"


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):  # gone, or a zombie
            pass
    return total


def _owned_files(pids: list[int]) -> list[str]:
    """What these processes own in /tmp (moe-*-<pid>-*) and /dev/shm (moe_*<pid>_*)."""
    tmp = tempfile.gettempdir()
    shm = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    out = []
    for pid in pids:
        out += [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith("moe-") and f"-{pid}-" in n]
        out += [f"/dev/shm/{n}" for n in shm if n.startswith("moe_") and f"_{pid}_" in n]
    return out


class _HealthProbe(threading.Thread):
    """GET /health every HEALTH_PERIOD_S until stopped: (seconds, status or the error) per probe."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.probes, self.done = url, [], threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.done.is_set():
                t0 = time.monotonic()
                try:
                    status = client.get(f"{self.url}/health").status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                self.probes.append((time.monotonic() - t0, status))
                self.done.wait(HEALTH_PERIOD_S)


def test_soak(model_dir, tmp_path):
    specs = plan(NUM_REQUESTS)
    log = tmp_path / "serve.log"
    srv = ServerProcess(model_dir, str(log))
    stopped, clients = False, []
    try:
        pids = process_tree(srv.proc.pid)
        assert any(f"moe-core-{srv.proc.pid}-" in p for p in _owned_files(pids)), "the check below looks at something"
        probe = _HealthProbe(srv.url)
        probe.start()
        outcomes: dict[str, int] = {}
        local = threading.local()

        def one(i: int) -> str:
            # Each client thread keeps its connection (and opens a new one after a hang-up).
            if getattr(local, "client", None) is None:
                local.client = httpx.Client(headers=headers(), timeout=120)
                clients.append(local.client)
            return _run(local.client, srv.url, specs[i])

        rss = []
        half = NUM_REQUESTS // 2
        t0 = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            for start in (0, half):
                for result in pool.map(one, range(start, start + half)):
                    outcomes[result] = outcomes.get(result, 0) + 1
                wait_until_idle(srv.url, 60)
                rss.append(_rss_bytes(process_tree(srv.proc.pid)))
        elapsed = time.monotonic() - t0
        probe.done.set()
        probe.join(30)

        expected = {"ok": "ok", "bad": "bad", "hung_up": "hang_up"}
        assert outcomes == {k: sum(s["expect"] == e for s in specs) for k, e in expected.items()}
        assert min(outcomes.values()) >= 10, outcomes  # the mix has some of each
        assert {s["kind"] for s in specs} == set(KINDS) and {s.get("bad") for s in specs} >= set(BADS)

        slowest = max(t for t, _ in probe.probes)
        assert len(probe.probes) >= 10 and {s for _, s in probe.probes} == {200}, probe.probes
        assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s under load"
        assert rss[1] - rss[0] < RSS_GROWTH_BOUND, f"RSS grew from {rss[0] >> 20} to {rss[1] >> 20} MiB"

        m = wait_until_idle(srv.url, 60)
        assert m["moe:num_requests_running"] == 0 and m["moe:num_requests_waiting"] == 0, m
        assert m["moe:kv_cache_usage_perc"] == 0
        good_sequences = sum(s["n"] * s["prompts"] for s in specs if s["expect"] == "ok")
        finished = m['moe:request_success_total{finished_reason="stop"}'] + \
            m['moe:request_success_total{finished_reason="length"}']
        hung_up = [s for s in specs if s["expect"] == "hang_up"]
        assert good_sequences <= finished <= good_sequences + len(hung_up), (finished, good_sequences)
        assert m['moe:request_success_total{finished_reason="abort"}'] >= sum(s["stream"] for s in hung_up)
        assert scrape_metrics(srv.url)["moe:num_requests_running"] == 0

        pids = process_tree(srv.proc.pid)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        stopped = True
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if os.path.exists(f"/proc/{p}")], "every process of the server exits"
        assert _owned_files(pids) == []
        text = log.read_text()
        assert "Traceback" not in text and "Logging error" not in text, text[-4000:]
        print(f"soak: {NUM_REQUESTS} requests {outcomes} in {elapsed:.1f} s; /health slowest {slowest * 1e3:.0f} ms "
              f"over {len(probe.probes)} probes; RSS {rss[0] >> 20} -> {rss[1] >> 20} MiB")
    finally:
        for client in clients:
            client.close()
        if not stopped:
            srv.stop()
