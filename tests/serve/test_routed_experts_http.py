"""`moe serve --enable-return-routed-experts`: each finished choice of /v1/completions and
/v1/chat/completions, streamed or not, carries its routed experts (base64 of the .npy), equal to
the offline LLM's on the same tokens."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from moe import LLM, SamplingParams
from tests.serve.helpers import ENGINE_ARGS, MODEL_NAME, ServerProcess, headers

PROMPT_IDS = [5, 60, 7, 81, 9, 100, 11, 12, 130, 14, 15, 160, 17, 18, 19, 200, 21, 22, 23]
MAX_TOKENS = 4


def decode(encoded: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"),
                        extra=["--enable-return-routed-experts", "--max-num-batched-tokens", "16"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    with LLM(model_dir, **ENGINE_ARGS, enable_return_routed_experts=True) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT_IDS},
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return out[0].outputs[0].routed_experts


def _body(**extra) -> dict:
    return {"model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}


def test_each_completion_choice_carries_its_routed_experts(server, offline):
    assert offline.shape[0] == len(PROMPT_IDS) + MAX_TOKENS - 1
    r = httpx.post(f"{server.url}/v1/completions", json=_body(prompt=PROMPT_IDS), headers=headers(), timeout=60)
    assert r.status_code == 200, r.text
    got = decode(r.json()["choices"][0]["routed_experts"])
    assert got.dtype == np.int16 and got.shape == offline.shape and (got == offline).all()
    # n samples: each its own generated tokens' routing after the shared prompt's
    r = httpx.post(f"{server.url}/v1/completions", json=_body(prompt=PROMPT_IDS, n=2, temperature=1.0, seed=3),
                   headers=headers(), timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for c in choices:
        got = decode(c["routed_experts"])
        assert got.shape == offline.shape and (got[:len(PROMPT_IDS)] == offline[:len(PROMPT_IDS)]).all()


def test_streamed_completion_sends_them_with_the_finish(server, offline):
    with httpx.stream("POST", f"{server.url}/v1/completions", json=_body(prompt=PROMPT_IDS, stream=True),
                      headers=headers(), timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    with_routing = [c for c in chunks for ch in c["choices"] if "routed_experts" in ch]
    assert len(with_routing) == 1 and with_routing[0]["choices"][0]["finish_reason"] == "length"
    got = decode(with_routing[0]["choices"][0]["routed_experts"])
    assert (got == offline).all()


def test_chat_choices_carry_them_too(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=headers(), timeout=60,
                   json=_body(messages=[{"role": "user", "content": "hello there"}]))
    assert r.status_code == 200, r.text
    body = r.json()
    got = decode(body["choices"][0]["routed_experts"])
    forwarded = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
    assert got.shape[0] == forwarded and got.ndim == 3
