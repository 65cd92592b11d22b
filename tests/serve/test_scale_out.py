"""`--api-server-count 2` (two API processes on one port) in front of `-dp 2` (two data-parallel
replicas in the engine core): the same answers as the offline LLM, both API processes used, and
/metrics summed over them (not multiplied, not lost)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from moe import SamplingParams
from tests.serve.helpers import MODEL_NAME, ServerProcess, headers, scrape_metrics

PROMPTS = [f"Hello there {i}" for i in range(12)]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"),
                        extra=["--api-server-count", "2", "-dp", "2"], startup_s=180)
    yield srv
    srv.stop()


def test_two_api_servers_two_replicas_same_answers_and_summed_metrics(server, llm):
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

    results = asyncio.run(main())
    assert [body["choices"][0]["text"] for _, body in results] == want
    assert {index for index, _ in results} == {"0", "1"}
    m = scrape_metrics(server.url)
    assert m["moe:request_success_total"] == len(PROMPTS)
    assert m["moe:prompt_tokens_total"] == sum(body["usage"]["prompt_tokens"] for _, body in results)
    assert m["moe:generation_tokens_total"] == 6 * len(PROMPTS)
    assert m["moe:time_to_first_token_seconds_count"] == len(PROMPTS)
    assert m["moe:kv_cache_usage_perc"] == 0
