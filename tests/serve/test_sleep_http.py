"""vLLM's development endpoints of sleep mode (VLLM_SERVER_DEV_MODE=1): POST /sleep frees the
engine's KV cache and weights, requests are then refused with a 503 that says why, POST /wake_up
restores it and the same greedy completion comes back."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.helpers import MODEL_NAME, ServerProcess, headers


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"),
                        env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    srv.stop()


def _complete(server):
    return httpx.post(f"{server.url}/v1/completions", headers=headers(), timeout=60, json={
        "model": MODEL_NAME, "prompt": [5, 60, 7, 81], "max_tokens": 6, "temperature": 0, "ignore_eos": True})


def _call(server, method: str, path: str):
    r = httpx.request(method, f"{server.url}{path}", headers=headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_sleep_refuse_wake_up(server):
    before = _complete(server)
    assert before.status_code == 200, before.text
    assert _call(server, "GET", "/is_sleeping") == {"is_sleeping": False}
    assert _call(server, "POST", "/sleep?level=1")["is_sleeping"] is True
    assert _call(server, "GET", "/is_sleeping") == {"is_sleeping": True}
    asleep = _complete(server)
    assert asleep.status_code == 503 and "asleep" in asleep.text
    again = httpx.post(f"{server.url}/sleep?level=1", headers=headers(), timeout=60)
    assert again.status_code == 400 and "already asleep" in again.text
    assert _call(server, "POST", "/wake_up") == {"is_sleeping": False}
    after = _complete(server)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    bad = httpx.post(f"{server.url}/sleep?level=3", headers=headers(), timeout=60)
    assert bad.status_code == 400 and "sleep level" in bad.text
