"""/ping, /tokenize and /detokenize (vLLM's), and chat on the built-in model's ChatML template, on
a `moe serve` of tiny-qwen3-moe with an API key."""
from __future__ import annotations

import httpx
import pytest

from moe.engine.tokenizer import Tokenizer
from tests.serve.helpers import ENGINE_ARGS, MODEL_NAME, ServerProcess, headers

MESSAGES = [{"role": "user", "content": "How are you today?"}]
CHATML = "<|im_start|>user\nHow are you today?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from models.tiny import ensure_tiny_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return ensure_tiny_model("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    srv = ServerProcess(tiny, str(tmp_path_factory.mktemp("log") / "serve.log"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=kw.pop("headers", headers()), timeout=30, **kw)


def test_ping_answers_get_and_post_without_the_key(server):
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{server.url}/ping", timeout=5)
        assert r.status_code == 200, (method, r.text)


def test_tokenize_and_detokenize_need_the_key(server):
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]})):
        r = post(server, path, body, headers={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"


def test_tokenize_a_prompt_and_detokenize_it_back(server, tiny):
    tok = Tokenizer(tiny)
    r = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "Hello, world!"})
    assert r.status_code == 200, r.text
    ids = tok.encode("Hello, world!")
    assert r.json() == {"count": len(ids), "max_model_len": ENGINE_ARGS["max_model_len"], "tokens": ids,
                        "token_strs": None}
    strs = post(server, "/tokenize", {"prompt": "Hello", "return_token_strs": True}).json()["token_strs"]
    assert strs == [tok.backend.id_to_token(t) for t in tok.encode("Hello")]
    r = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello, world!"}


def test_tokenize_messages_applies_the_chatml_template(server, tiny):
    tok = Tokenizer(tiny)
    r = post(server, "/tokenize", {"model": MODEL_NAME, "messages": MESSAGES})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == tok.encode(CHATML, add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == CHATML  # special tokens kept
    no_opener = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_opener["tokens"] == tok.encode(CHATML[:-len("<|im_start|>assistant\n")], add_special_tokens=False)
    # the chat endpoint renders the same prompt on the built-in model
    r = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2,
                                              "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("path, body, status, says", [
    ("/tokenize", {"prompt": "Hi", "messages": MESSAGES}, 400, "either prompt"),
    ("/tokenize", {}, 400, "either prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{% for %}"}, 400, "chat template"),
    ("/tokenize", {"model": "other", "prompt": "Hi"}, 404, "does not exist"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1 << 20]}, 400, "out of vocabulary"),
])
def test_bad_bodies_get_openai_style_errors(server, path, body, status, says):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["code"] == status and r.json()["object"] == "error"
