"""`--api-server-count 2` (two API processes on one port) in front of `-dp 2` (two engine core
processes, one per data-parallel replica): the same answers as the offline LLM, both API
processes used, and /metrics summed over them (not multiplied, not lost)."""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from moe import SamplingParams
from tests.serve.helpers import MODEL_NAME, ServerProcess, expert_tokens_total, headers, process_tree, scrape_metrics

PROMPTS = [f"Hello there {i}" for i in range(12)]


def _is_core(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"moe.engine.core_process" in f.read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"),
                        extra=["--api-server-count", "2", "-dp", "2"], startup_s=180)
    yield srv
    srv.stop()


def test_two_api_servers_two_replicas_same_answers_and_summed_metrics(server, llm, model_dir):
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)]

    async def one(prompt):
        # A client per request: a new connection each, which the kernel deals to either process.
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=60) as http:
            r = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.headers["x-moe-api-server"], r.json()

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 90)

    cores = [pid for pid in process_tree(server.proc.pid) if _is_core(pid)]
    assert len(cores) == 2
    results = asyncio.run(main())
    assert [body["choices"][0]["text"] for _, body in results] == want
    assert {index for index, _ in results} == {"0", "1"}
    m = scrape_metrics(server.url)
    assert m["moe:request_success_total"] == len(PROMPTS)
    assert m["moe:prompt_tokens_total"] == sum(body["usage"]["prompt_tokens"] for _, body in results)
    assert m["moe:generation_tokens_total"] == 6 * len(PROMPTS)
    assert m["moe:time_to_first_token_seconds_count"] == len(PROMPTS)
    assert m["moe:kv_cache_usage_perc"] == 0
    # Expert load: each routed slot once, whichever core ran it and however many API processes listen
    # (the cores send their last window when they go idle).
    top_k = json.load(open(f"{model_dir}/config.json"))["num_experts_per_tok"]
    layers = len(httpx.get(f"{server.url}/dashboard/data.json", headers=headers(), timeout=5).json()["meta"]["layers"])
    want = top_k * layers * sum(body["usage"]["prompt_tokens"] + 6 - 1 for _, body in results)
    deadline = time.monotonic() + 10
    while expert_tokens_total(server.url) < want and time.monotonic() < deadline:
        time.sleep(0.1)
    assert expert_tokens_total(server.url) == want


def test_bench_serve_against_the_server(server, tmp_path, monkeypatch, capsys):
    import json

    from moe.entrypoints.cli import main
    from tests.serve.helpers import API_KEY

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    before = scrape_metrics(server.url)
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "8",
               "--random-output-len", "4", "--request-rate", "50", "--max-concurrency", "3", "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", str(tmp_path / "new"), "--result-filename", "r.json"])  # a folder made for it
    assert rc == 0
    result = json.loads((tmp_path / "new" / "r.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["model_id"] == MODEL_NAME
    assert result["prompt_format"] == "text"  # the tokenizer of the server's model root, as vLLM sends text
    assert result["total_input_tokens"] == 6 * 8 and result["total_output_tokens"] == 6 * 4
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{name}_ms"] <= result[f"p99_{name}_ms"]
    assert result["mean_e2el_ms"] > result["mean_ttft_ms"]
    assert scrape_metrics(server.url)["moe:generation_tokens_total"] - before["moe:generation_tokens_total"] == 24
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_bench_serve_sharegpt_sends_each_prompt_for_its_answers_length(server, model_dir, tmp_path, monkeypatch):
    from moe.bench.datasets import sharegpt_requests
    from moe.engine.tokenizer import load_tokenizer
    from moe.entrypoints.cli import main
    from tests.serve.helpers import API_KEY

    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    data = [{"conversations": [{"from": "human", "value": f"Question {i}: " + "why is the sky blue " * (1 + i % 3)},
                               {"from": "gpt", "value": "Because of the light " * (1 + i % 4)}]} for i in range(8)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    want = sharegpt_requests(str(path), 5, load_tokenizer(model_dir), seed=3)
    before = scrape_metrics(server.url)
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
               "--num-prompts", "5", "--seed", "3", "--request-rate", "50", "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path / "new"), "--result-filename", "r.json"])  # a folder made for it
    assert rc == 0
    result = json.loads((tmp_path / "new" / "r.json").read_text())
    assert result["completed"] == 5 and result["dataset_name"] == "sharegpt" and result["prompt_format"] == "text"
    assert result["total_input_tokens"] == sum(r.prompt_len for r in want)  # as the server counted them
    assert result["total_output_tokens"] == sum(r.output_len for r in want) and len({r.output_len for r in want}) > 1
    assert scrape_metrics(server.url)["moe:generation_tokens_total"] - before["moe:generation_tokens_total"] == \
        sum(r.output_len for r in want)
    # the same requests through the chat completions API: each prompt one user message in the chat template
    rc = main(["bench", "serve", "--base-url", server.url, "--backend", "openai-chat", "--dataset-name", "sharegpt",
               "--dataset-path", str(path), "--num-prompts", "5", "--seed", "3", "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "chat.json"])
    assert rc == 0
    chat = json.loads((tmp_path / "chat.json").read_text())
    assert chat["completed"] == 5 and chat["endpoint"] == "/v1/chat/completions"
    assert chat["total_output_tokens"] == result["total_output_tokens"]
    assert chat["total_input_tokens"] > result["total_input_tokens"]  # the template's tokens around each prompt
    assert 0 < chat["median_ttft_ms"] and 0 < chat["median_tpot_ms"]


def test_sigterm_drains_in_flight_requests_then_exits(server):
    """Keep last: the server is stopped here. A stream in flight when SIGTERM arrives still ends
    with all its tokens and [DONE]; then every process exits."""
    import json
    import signal
    import threading
    import time

    pids = process_tree(server.proc.pid)
    got = {}

    def stream():
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers(), timeout=60) as r:
            got["events"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert not t.is_alive()
    events = got["events"]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 40
    assert server.proc.wait(60) == 0
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")]
