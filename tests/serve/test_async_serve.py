"""`moe serve --async-scheduling`: the engine core pipelines its steps; completions (plain, streamed,
with a stop string, seeded n=2) equal the synchronous offline `LLM`'s."""
from __future__ import annotations

import openai
import pytest

from moe import SamplingParams
from tests.serve.helpers import API_KEY, MODEL_NAME, ServerProcess

PROMPTS = ["Hello, world!", "The quick brown fox", "Mixture-of-experts models route"]


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"), extra=["--async-scheduling"])
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key=API_KEY, timeout=60.0, max_retries=0)
    log = srv.read_log()
    srv.stop()
    assert "steps run synchronously" not in log, "the server's engine core took the async path"


def test_async_server_equals_synchronous_offline(client, llm):
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=14, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == want
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=14, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == want[1]
    stop = want[2][4:6]
    ref = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0].text
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=14, temperature=0.0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref and resp.choices[0].finish_reason == "stop"
    seeded = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    want = [o.text for o in llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], n=2, temperature=0.8, seed=7, max_tokens=8,
                                     extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == want
