"""Request bodies OpenAI's API refuses are refused here too, with a 400 whose message names the field:
values of the wrong JSON type (no "3" or 3.0 for an integer, no "yes" for a boolean, no true for a
token id), integers beyond int64, an `n` above the server's limit, and strings that are not valid
Unicode (lone surrogates sent as \\uXXXX escapes). What real clients send keeps working."""
from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from moe.entrypoints.serve import protocol
from moe.sampling_params import INT64_MAX
from tests.serve.helpers import MODEL_NAME, ServerProcess, headers

BIG = 2**63
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes non-ASCII (ensure_ascii): a lone surrogate goes out as a valid \ud800
    # escape, as any client may send it (httpx's json= would fail to encode it).
    return httpx.post(f"{server.url}/v1/{path}", content=json.dumps(body), timeout=30,
                      headers={**headers(), "content-type": "application/json"})


def assert_400_naming(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError"
    assert field in err["message"], err


BAD_COMPLETIONS = [
    # token ids are JSON integers: not booleans, not floats
    ("prompt", {"prompt": [True, 5]}),
    ("prompt", {"prompt": [[1, True]]}),
    ("prompt", {"prompt": [1.0, 2]}),
    ("prompt", {"prompt": [1.5]}),
    ("prompt", {"prompt": ["a", 1]}),
    # integers: not strings, floats or booleans; within int64
    ("max_tokens", {"max_tokens": "3"}),
    ("max_tokens", {"max_tokens": 3.5}),
    ("max_tokens", {"max_tokens": 3.0}),
    ("max_tokens", {"max_tokens": True}),
    ("max_tokens", {"max_tokens": BIG}),
    ("max_tokens", {"max_tokens": 10**30}),
    ("n", {"n": "2", "temperature": 1}),
    ("n", {"n": True}),
    ("n", {"n": 2.0, "temperature": 1}),
    ("top_k", {"top_k": "5"}),
    ("top_k", {"top_k": 2.0}),
    ("top_k", {"top_k": BIG}),
    ("seed", {"seed": "7"}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": BIG}),
    ("seed", {"seed": 2**64}),
    ("min_tokens", {"min_tokens": True}),
    ("min_tokens", {"min_tokens": BIG, "max_tokens": None}),
    ("logprobs", {"logprobs": True}),
    ("logprobs", {"logprobs": "2"}),
    ("logprobs", {"logprobs": BIG}),
    ("stop_token_ids", {"stop_token_ids": [True]}),
    ("stop_token_ids", {"stop_token_ids": [2**64]}),
    # booleans: true or false only
    ("stream", {"stream": "yes"}),
    ("stream", {"stream": 1}),
    ("echo", {"echo": "true"}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": "yes"}}),
    # numbers: an integer or a float, not a string or a boolean
    ("temperature", {"temperature": "0.5"}),
    ("temperature", {"temperature": True}),
    ("top_p", {"top_p": "1"}),
    # n within the server's limit
    ("n", {"n": 20000, "temperature": 1}),
    ("n", {"n": protocol.MAX_N + 1, "temperature": 1}),
    ("n", {"n": BIG, "temperature": 1}),
    # lone surrogates
    ("prompt", {"prompt": "abc \ud800 def"}),
    ("prompt", {"prompt": ["ok", "\udfff"]}),
    ("stop", {"stop": "\ud800"}),
    ("stop", {"stop": ["x", "y\udc00"]}),
    ("model", {"model": "tiny\ud800"}),
    ("user", {"user": "\ud800"}),
    ("suffix", {"suffix": "\ud800"}),
]

BAD_CHATS = [
    ("messages", {"messages": [{"role": "user", "content": "hi \ud800"}]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}),
    ("messages", {"messages": [{"role": "\ud800", "content": "hi"}]}),
    ("stop", {"stop": ["\ud800"]}),
    ("chat_template", {"chat_template": "{{ '\ud800' }}"}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"x": "\ud800"}}),
    ("logprobs", {"logprobs": "yes"}),
    ("logprobs", {"logprobs": 1}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": "3"}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": True}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": BIG}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": -1}),
    ("max_completion_tokens", {"max_completion_tokens": 2.5}),
    ("max_completion_tokens", {"max_completion_tokens": BIG}),
    ("add_generation_prompt", {"add_generation_prompt": "no"}),
    ("continue_final_message", {"continue_final_message": 1}),
    ("n", {"n": 20000, "temperature": 1}),
    ("stream", {"stream": "yes"}),
]


@pytest.mark.parametrize("field, change", BAD_COMPLETIONS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_completion_is_400_naming_the_field(server, field, change):
    assert_400_naming(post(server, "completions", {**COMPLETION, **change}), field)


@pytest.mark.parametrize("field, change", BAD_CHATS, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_chat_is_400_naming_the_field(server, field, change):
    assert_400_naming(post(server, "chat/completions", {**CHAT, **change}), field)


GOOD_COMPLETIONS = [
    {"temperature": 1, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0},
    {"temperature": 0.0, "seed": None, "stop": "x", "user": "u-1"},
    {"stop": ["x", "y"], "stop_token_ids": [3], "logprobs": 2, "echo": True},
    {"logprobs": 0, "top_k": -1, "seed": -1},
    {"top_k": INT64_MAX, "seed": INT64_MAX, "n": 2, "temperature": 1},  # samples seeded INT64_MAX and + 1
    {"n": protocol.MAX_N, "temperature": 0.7, "max_tokens": 1},
    {"prompt": [7] * 250, "max_tokens": None},  # up to max_model_len=256: 6 tokens
    {"prompt": [[1, 2, 3], [4, 5]], "stream": False, "ignore_eos": True},
    {"prompt": ["a", "b"], "best_of": 2, "\ud800": 1},  # unknown fields, even of a bad name, are ignored
]


@pytest.mark.parametrize("change", GOOD_COMPLETIONS)
def test_what_clients_send_still_works_on_completions(server, change):
    r = post(server, "completions", {**COMPLETION, **change})
    assert r.status_code == 200, r.text
    assert r.json()["choices"]


GOOD_CHATS = [
    {"temperature": 1, "logprobs": True, "top_logprobs": 2, "seed": None},
    {"max_tokens": None, "max_completion_tokens": 2, "stop": "x", "logprobs": False},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "top_logprobs": None},
]


@pytest.mark.parametrize("change", GOOD_CHATS)
def test_what_clients_send_still_works_on_chat(server, change):
    r = post(server, "chat/completions", {**CHAT, **change})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_streams_still_work(server):
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers(), timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]


def test_max_n_is_read_at_each_request(monkeypatch):
    """The server may lower (or raise) the limit after import: the next request sees it."""
    monkeypatch.setattr(protocol, "MAX_N", 4)
    assert protocol.CompletionRequest.model_validate({"prompt": "x", "n": 4}).n == 4
    with pytest.raises(ValidationError, match=r"n=5 is more than this server allows: at most 4 samples"):
        protocol.CompletionRequest.model_validate({"prompt": "x", "n": 5})
    with pytest.raises(ValidationError, match="at most 4 samples"):
        protocol.ChatCompletionRequest.model_validate({"messages": [], "n": 5})


def test_server_kept_serving_and_logged_no_error(server):
    """Keep last: after every refusal above, a plain request works and nothing failed inside."""
    r = post(server, "completions", COMPLETION)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    log = server.read_log()
    assert "Traceback" not in log and "Logging error" not in log, log
