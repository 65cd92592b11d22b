"""`moe serve` end to end on loopback: a server subprocess (engine core in a process of its own)
against the offline `LLM` on the same checkpoint, through the real `openai` client and raw HTTP.

The tests share one server; the last one kills its engine core (keep it last)."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from moe import SamplingParams
from tests.serve.helpers import (API_KEY, MODEL_NAME, ServerProcess, expert_tokens_total, headers,
                                 scrape_metrics, wait_until_idle)

PROMPTS = ["Hello, world!", "The quick brown fox", "Mixture-of-experts models route", "Numbers: 1 2 3"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "How are you today?"}]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # Room in one batch for every stream of the concurrency test (a later flag wins over helpers' 32).
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"), extra=["--max-num-seqs", "80"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, timeout=60.0, max_retries=0)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def offline_texts(llm, prompts, params) -> list[str]:
    return [o.text for out in llm.generate(prompts, params, use_tqdm=False) for o in out.outputs]


def sse_events(response: httpx.Response) -> list:
    """The data of every server-sent event, JSON-decoded except the final [DONE]."""
    events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_completions_equal_offline(client, llm):
    params = greedy(12, ignore_eos=True)
    ref = llm.generate(PROMPTS, params, use_tqdm=False)
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in ref]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert resp.usage.completion_tokens == 12 * len(PROMPTS)
    # Token ids as the prompt, a stop string, and seeded sampling with n=2.
    ids = ref[0].prompt_token_ids
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref[0].outputs[0].text
    stop = ref[1].outputs[0].text[3:5]
    want = offline_texts(llm, PROMPTS[1], greedy(12, ignore_eos=True, stop=[stop]))
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0.0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want[0] and resp.choices[0].finish_reason == "stop"
    want = offline_texts(llm, PROMPTS[2], SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True))
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], n=2, temperature=0.8, seed=7, max_tokens=8,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == want


def test_completion_logprobs_and_echo(client, llm):
    """With echo, logprobs cover the echoed prompt too (vLLM's shape): its first token has none."""
    out = llm.generate(PROMPTS[0], greedy(5, logprobs=2, prompt_logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    ref, prompt_ids = out.outputs[0], out.prompt_token_ids
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0.0,
                                     logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.text == PROMPTS[0] + ref.text
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], prompt_ids[1:])]
        + [step[t].logprob for step, t in zip(ref.logprobs, ref.token_ids)], abs=1e-5)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0.0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    assert resp.choices[0].logprobs.token_logprobs == pytest.approx(
        [step[t].logprob for step, t in zip(ref.logprobs, ref.token_ids)], abs=1e-5)


def test_streamed_completion_equals_offline_raw_http(server, llm):
    want = offline_texts(llm, PROMPTS[:2], greedy(10, ignore_eos=True))
    body = {"model": MODEL_NAME, "prompt": PROMPTS[:2], "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers(), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 20
    texts = ["", ""]
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == want
    assert len(events) > 4  # streamed in pieces, not one chunk


def test_chat_equals_offline_chat(client, llm):
    ref = llm.chat(MESSAGES, greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0.0,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].message.content == ref and resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"
    # logprobs / top_logprobs in the chat format
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0.0,
                                          logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top token


def test_chat_continue_final_message_and_echo_equal_offline(server, client, llm, model_dir):
    """continue_final_message: the prompt transformers renders with continue_final_message=True,
    generated offline (greedy) from its tokens; echo prepends the continued message's content."""
    from transformers import PreTrainedTokenizerFast

    partial = "I am fine, and"
    messages = [*MESSAGES, {"role": "assistant", "content": partial}]
    text = PreTrainedTokenizerFast.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith(partial)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    ref = llm.generate({"prompt_token_ids": ids}, greedy(8, ignore_eos=True), use_tqdm=False)[0]
    common = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0.0)
    resp = client.chat.completions.create(**common, extra_body={
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False})
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)
    # add_generation_prompt left out: continue_final_message turns it off (as vLLM accepts it)
    resp = client.chat.completions.create(**common, extra_body={
        "ignore_eos": True, "continue_final_message": True, "echo": True})
    assert resp.choices[0].message.content == partial + ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(**common, stream=True, extra_body={
        "ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == partial + ref.outputs[0].text
    # echo after a user message: the reply is the assistant's, a different role, so nothing is prepended
    want = llm.chat(MESSAGES, greedy(6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0.0,
                                          extra_body={"ignore_eos": True, "echo": True})
    assert resp.choices[0].message.content == want
    # add_generation_prompt false alone: the offline chat with the same switch
    want = llm.chat(MESSAGES, greedy(6, ignore_eos=True), add_generation_prompt=False,
                    use_tqdm=False)[0].outputs[0].text
    resp = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0.0,
                                          extra_body={"ignore_eos": True, "add_generation_prompt": False})
    assert resp.choices[0].message.content == want and resp.choices[0].message.role == "user"


def test_chat_continue_final_message_with_generation_prompt_is_400(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "continue_final_message": True,
            "add_generation_prompt": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers(), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "continue_final_message" in err["message"] and "add_generation_prompt" in err["message"]
    assert err["code"] == 400


def test_best_of_is_ignored_as_by_vllm(client, llm):
    """vLLM's current server has no best_of (dropped with its V1 engine): the field is ignored."""
    want = offline_texts(llm, PROMPTS[3], greedy(5, ignore_eos=True))
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=5, temperature=0.0,
                                     best_of=3, extra_body={"ignore_eos": True})
    assert [c.text for c in resp.choices] == want


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{server.url}/version", timeout=5).json()["version"]


@pytest.mark.parametrize("body, status, match", [
    ("{not json", 400, ""),
    ({"model": "other-model", "prompt": "hi"}, 404, "does not exist"),
    ({"model": MODEL_NAME}, 400, "prompt is required"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "hi", "logprobs": 50}, 400, "logprobs=50"),
    ({"model": MODEL_NAME, "prompt": [7] * 300}, 400, "max_model_len=256"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
])
def test_bad_requests_get_4xx_and_server_keeps_serving(server, client, body, status, match):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/completions", content=data, timeout=30,
                   headers={**headers(), "content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["code"] == status and err["type"]
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices[0].text is not None


def test_tools_need_the_auto_tool_choice_flags_as_in_vllm(client):
    """This server has no --enable-auto-tool-choice: tools default to tool_choice "auto", a 400;
    "none" renders them and reads no calls (tests/serve/test_structured_tools_server.py has the rest)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="requires --enable-auto-tool-choice and --tool-call-parser"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools, max_tokens=2)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=tools, tool_choice="none",
                                       max_tokens=2)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


def test_wrong_api_key_is_401(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"}, timeout=10,
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


NUM_STREAMS, NUM_QUITTERS, STREAM_TOKENS, QUITTER_TOKENS = 64, 8, 8, 200


def test_concurrent_streams_with_disconnects_free_the_kv_cache(server, llm):
    """64 clients stream to the end while 8 others hang up after two chunks of a long request: the
    64 get the offline (greedy) text, the 8 are aborted (no success counted), and the KV cache
    ends empty. Loopback only; every loop is bounded in chunks and the whole run in time."""
    total = NUM_STREAMS + NUM_QUITTERS
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(total)]
    want = offline_texts(llm, prompts[:NUM_STREAMS], greedy(STREAM_TOKENS, ignore_eos=True))
    before = scrape_metrics(server.url)

    async def one(http, i):
        quitter = i >= NUM_STREAMS
        max_tokens = QUITTER_TOKENS if quitter else STREAM_TOKENS
        body = {"model": MODEL_NAME, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, chunks = "", 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                chunks += 1
                assert chunks <= max_tokens, "more chunks than tokens"
                if quitter and chunks == 2:
                    return None  # leaving the block closes the connection mid-stream
        return text

    peak = {"running": 0.0}

    async def watch(http, streams):
        """The most requests the engine ran at once (its gauge), sampled until the streams end."""
        from prometheus_client.parser import text_string_to_metric_families

        for _ in range(2000):  # bounded: 2000 x 20 ms at most
            if streams.done():
                return
            text = (await http.get("/metrics")).text
            for fam in text_string_to_metric_families(text):
                for sample in fam.samples:
                    if sample.name == "moe:num_requests_running":
                        peak["running"] = max(peak["running"], sample.value)
            await asyncio.sleep(0.02)

    async def main():
        limits = httpx.Limits(max_connections=total + 1, max_keepalive_connections=total + 1)
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=60, limits=limits) as http:
            streams = asyncio.gather(*(one(http, i) for i in range(total)))
            watcher = asyncio.create_task(watch(http, streams))
            try:
                return await asyncio.wait_for(streams, 90)
            finally:
                await asyncio.wait_for(watcher, 30)

    texts = asyncio.run(main())
    assert peak["running"] >= NUM_STREAMS  # all in one batch, not queued behind each other
    assert texts[:NUM_STREAMS] == want and texts[NUM_STREAMS:] == [None] * NUM_QUITTERS
    m = wait_until_idle(server.url, 10, poll_s=0.2)
    assert m["moe:kv_cache_usage_perc"] == 0 and m["moe:num_requests_running"] == 0
    assert m["moe:num_requests_waiting"] == 0
    capped = 'moe:request_success_total{finished_reason="length"}'
    aborted = 'moe:request_success_total{finished_reason="abort"}'
    assert m[capped] - before[capped] == NUM_STREAMS  # their max_tokens
    assert m[aborted] - before[aborted] == NUM_QUITTERS
    # the quitters stopped early: far fewer than their tokens were generated
    generated = m["moe:generation_tokens_total"] - before["moe:generation_tokens_total"]
    finished = NUM_STREAMS * STREAM_TOKENS
    assert finished <= generated < finished + NUM_QUITTERS * QUITTER_TOKENS // 2


def test_metrics_count_requests_and_latencies(server, client):
    before = scrape_metrics(server.url)
    resp = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0.0,
                                      extra_body={"ignore_eos": True}) for p in PROMPTS[:3]]
    m = scrape_metrics(server.url)

    def delta(name):
        return m[name] - before.get(name, 0.0)

    assert delta("moe:request_success_total") == 3
    assert delta('moe:request_success_total{finished_reason="length"}') == 3
    assert delta("moe:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in resp)
    assert delta("moe:generation_tokens_total") == 12
    for hist in ("moe:time_to_first_token_seconds", "moe:e2e_request_latency_seconds",
                 "moe:request_queue_time_seconds", "moe:request_prefill_time_seconds",
                 "moe:request_decode_time_seconds", "moe:request_inference_time_seconds",
                 "moe:request_time_per_output_token_seconds", "moe:request_prompt_tokens",
                 "moe:request_generation_tokens", "moe:request_params_n", "moe:request_params_max_tokens",
                 "moe:request_max_num_generation_tokens"):
        assert delta(f"{hist}_count") == 3 and delta(f"{hist}_sum") >= 0, hist
    assert delta("moe:request_generation_tokens_sum") == 12 and delta("moe:request_params_max_tokens_sum") == 12
    assert delta("moe:inter_token_latency_seconds_count") == 3 * 3
    assert delta("moe:iteration_tokens_total_sum") == delta("moe:prompt_tokens_total") + 12
    assert delta("moe:e2e_request_latency_seconds_sum") > delta("moe:time_to_first_token_seconds_sum") > 0
    # the KV-cache configuration, with the core's block count; token-count buckets end at the context
    info = [k for k in m if k.startswith("moe:cache_config_info{")]
    assert len(info) == 1 and 'num_gpu_blocks="' in info[0] and 'num_gpu_blocks="None"' not in info[0]
    text = httpx.get(f"{server.url}/metrics", headers=headers(), timeout=5.0).text
    edges = [float(e) for e in re.findall(r'moe:request_prompt_tokens_bucket\{[^}]*le="([^"]+)"', text) if e != "+Inf"]
    max_model_len = httpx.get(f"{server.url}/v1/models", headers=headers(), timeout=5.0).json()["data"][0][
        "max_model_len"]
    assert edges and max(edges) <= max_model_len


def test_expert_load_on_the_dashboard_and_in_metrics(server, client, model_dir):
    """The live dashboard's data and /metrics count each routed (token, expert) slot once."""
    top_k = json.load(open(f"{model_dir}/config.json"))["num_experts_per_tok"]
    page = httpx.get(f"{server.url}/dashboard/", headers=headers(), timeout=5.0)
    assert page.status_code == 200 and "<html" in page.text.lower()
    seen = httpx.get(f"{server.url}/dashboard/data.json", headers=headers(), timeout=5.0).json()
    layers = seen["meta"]["layers"]
    before = expert_tokens_total(server.url)
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=5, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    want = top_k * (resp.usage.prompt_tokens + resp.usage.completion_tokens - 1)  # the last token is not fed
    deadline, got = time.monotonic() + 10, []
    while time.monotonic() < deadline:  # the core sends its last window when it goes idle
        data = httpx.get(f"{server.url}/dashboard/data.json", headers=headers(),
                         params={"since": seen["last_index"] + 1}, timeout=5.0).json()
        got = [sum(sum(w["counts"][row]) for w in data["windows"]) for row in range(len(layers))]
        if got == [want] * len(layers):
            break
        time.sleep(0.1)
    assert got == [want] * len(layers)
    assert expert_tokens_total(server.url) - before == want * len(layers)
    text = httpx.get(f"{server.url}/metrics", headers=headers(), timeout=5.0).text
    assert all(f'moe:expert_load_balancedness{{layer="{layer}",model_name=' in text for layer in layers)


def test_client_gone_before_the_response_aborts_its_request(server):
    """A non-streaming client that hangs up: its request is aborted at once (not finished; its 250
    tokens take ~0.3 s here), blocks freed."""
    before = scrape_metrics(server.url)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", headers=headers(), timeout=0.1, json={
            "model": MODEL_NAME, "prompt": "hi", "max_tokens": 250, "ignore_eos": True, "temperature": 0})
    m = wait_until_idle(server.url, 5)
    assert m["moe:num_requests_running"] == 0 and m["moe:kv_cache_usage_perc"] == 0
    for reason in ("stop", "length", "error"):
        name = f'moe:request_success_total{{finished_reason="{reason}"}}'
        assert m[name] == before[name]
    aborted = 'moe:request_success_total{finished_reason="abort"}'
    assert m[aborted] - before[aborted] == 1
    assert m["moe:generation_tokens_total"] - before["moe:generation_tokens_total"] < 250


def test_killed_engine_core_gives_5xx_and_failing_health(server):
    """Keep last: the shared server's engine core is killed here."""
    results = {}

    def in_flight():
        try:
            r = httpx.post(f"{server.url}/v1/completions", headers=headers(), timeout=30, json={
                "model": MODEL_NAME, "prompt": "hi", "max_tokens": 250, "ignore_eos": True, "temperature": 0})
            results["status"] = r.status_code
        except httpx.HTTPError as e:
            results["status"] = repr(e)

    t = threading.Thread(target=in_flight)
    t.start()
    # Kill as soon as the request runs: its 250 tokens take ~0.3 s here, a fixed sleep could outlast it.
    deadline = time.monotonic() + 5
    while scrape_metrics(server.url)["moe:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    import os
    import signal

    killed_at = time.monotonic()
    os.kill(server.core_pid(), signal.SIGKILL)
    t.join(15)
    assert not t.is_alive() and isinstance(results["status"], int) and results["status"] >= 500, results
    assert time.monotonic() - killed_at < 10
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    r = httpx.post(f"{server.url}/v1/completions", headers=headers(), timeout=10,
                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "EngineDeadError"
    server.proc.send_signal(signal.SIGTERM)  # and the API process still stops cleanly
    assert server.proc.wait(20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
