"""The most samples (n) one request may ask for: $MOE_MAX_N_SEQUENCES, else $VLLM_MAX_N_SEQUENCES
(vLLM's name for it), else 128. Over HTTP with two API processes (spawned by the launcher: the limit
must reach each): n above the limit is a 400 naming it, n at the limit works, on both endpoints."""
from __future__ import annotations

import httpx
import pytest

from moe.entrypoints.serve import protocol
from moe.entrypoints.serve.api_server import resolve_max_n
from tests.serve.helpers import MODEL_NAME, ServerProcess, headers
from tests.test_cli import run_moe

LIMIT = 3


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("max-n") / "serve.log"
    # VLLM_MAX_N_SEQUENCES too: the MOE_ variable wins.
    srv = ServerProcess(model_dir, str(log), ["--api-server-count", "2"],
                        env={"MOE_MAX_N_SEQUENCES": str(LIMIT), "VLLM_MAX_N_SEQUENCES": "50"})
    yield srv
    srv.stop()


def _post(url: str, endpoint: str, n: int) -> httpx.Response:
    body = {"model": MODEL_NAME, "n": n, "temperature": 1.0, "max_tokens": 2, "seed": 1}
    if endpoint == "completions":
        body["prompt"] = "Hello there"
    else:
        body["messages"] = [{"role": "user", "content": "Hello there"}]
    # A client per call: a new connection, which the kernel may give to either API process.
    return httpx.post(f"{url}/v1/{endpoint}", json=body, headers=headers(), timeout=60)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_n_above_the_limit_is_a_400_naming_it_and_at_the_limit_works(server, endpoint):
    answered_by = set()
    for _ in range(16):  # until both API processes have answered both kinds of request
        over, at = _post(server.url, endpoint, LIMIT + 1), _post(server.url, endpoint, LIMIT)
        assert over.status_code == 400, over.text
        error = over.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError"
        assert f"n={LIMIT + 1} is more than this server allows: at most {LIMIT} samples" in error["message"]
        assert at.status_code == 200, at.text
        assert sorted(c["index"] for c in at.json()["choices"]) == list(range(LIMIT))
        answered_by |= {over.headers["x-moe-api-server"], at.headers["x-moe-api-server"]}
        if answered_by == {"0", "1"}:
            break
    assert answered_by == {"0", "1"}, "both API processes enforce the limit"


def test_the_limit_comes_from_the_environment():
    assert resolve_max_n({}) == protocol.DEFAULT_MAX_N == 128
    assert resolve_max_n({"VLLM_MAX_N_SEQUENCES": "7"}) == 7
    assert resolve_max_n({"MOE_MAX_N_SEQUENCES": "5", "VLLM_MAX_N_SEQUENCES": "7"}) == 5
    assert resolve_max_n({"MOE_MAX_N_SEQUENCES": " ", "VLLM_MAX_N_SEQUENCES": "7"}) == 7  # blank: unset
    for bad in ("0", "-2", "many", "2.5"):
        with pytest.raises(ValueError, match=f"MOE_MAX_N_SEQUENCES='{bad}' must be an integer >= 1"):
            resolve_max_n({"MOE_MAX_N_SEQUENCES": bad})


def test_a_bad_limit_stops_the_server_before_it_loads_anything(tmp_path):
    r = run_moe("serve", str(tmp_path / "not-loaded"), env={"VLLM_MAX_N_SEQUENCES": "0"})
    assert r.returncode == 1
    assert "VLLM_MAX_N_SEQUENCES='0' must be an integer >= 1" in r.stderr and "Traceback" not in r.stderr
