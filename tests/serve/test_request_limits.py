"""Requests the server refuses with a 400 naming the problem, before anything is queued: chat content
of the wrong type, too many or empty prompts in one completion request, and a max_tokens that does
not fit beside the prompt in the model's context (an unset max_tokens is capped to fit instead)."""
from __future__ import annotations

import re

import httpx
import pytest

from moe.entrypoints.serve import protocol
from tests.serve.helpers import ENGINE_ARGS, MODEL_NAME, ServerProcess, headers

MAX_LEN = ENGINE_ARGS["max_model_len"]  # 256
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL_NAME, **body}, headers=headers(), timeout=60)


def error_message(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["object"] == "error" and body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    return body["error"]["message"]


# ---- chat content ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content,shown", [(5, "int 5"), ({"text": "hi"}, "dict {'text': 'hi'}"),
                                           (True, "bool True"), (None, None)])
def test_chat_content_of_the_wrong_type_is_a_400_naming_index_and_type(server, content, shown):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}, {"echo": True}):
        message = error_message(post(server, "chat/completions", {"messages": messages, "max_tokens": 1, **extra}))
        if shown is None:
            assert message.startswith("messages[1]['content'] is missing or null"), message
        else:
            assert message == f"messages[1]['content'] must be a string or a list of content parts, got {shown}"


def test_assistant_content_may_be_null(server):
    messages = [*MESSAGES, {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    r = post(server, "chat/completions", {"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_colliding_template_kwargs_name_every_key(server):
    r = post(server, "chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {
        "messages": [], "add_generation_prompt": True, "mood": "calm"}})
    assert error_message(r).startswith("chat_template_kwargs cannot set 'messages', 'add_generation_prompt': ")


# ---- the number of prompts ------------------------------------------------------------------------

def test_the_prompt_list_is_bounded():
    at_limit = protocol.CompletionRequest(prompt=[[1, 2]] * protocol.MAX_PROMPTS)
    assert len(at_limit.prompts()) == protocol.MAX_PROMPTS
    # One prompt of many token ids is not many prompts.
    assert len(protocol.CompletionRequest(prompt=[1] * 5000).prompts()) == 1
    with pytest.raises(ValueError, match=f"prompt holds {protocol.MAX_PROMPTS + 1} prompts, .* at most "
                                         f"{protocol.MAX_PROMPTS} prompts per request"):
        protocol.CompletionRequest(prompt=["a"] * (protocol.MAX_PROMPTS + 1))


@pytest.mark.parametrize("prompt", [["x"] * (protocol.MAX_PROMPTS + 1), [[1]] * 1_000_000])
def test_too_many_prompts_are_a_400_naming_the_limit(server, prompt):
    message = error_message(post(server, "completions", {"prompt": prompt, "max_tokens": 1}))
    assert f"prompt holds {len(prompt)} prompts" in message and f"at most {protocol.MAX_PROMPTS}" in message


@pytest.mark.parametrize("prompt,match", [
    ([], "prompt is required"),
    ("", "prompt is required"),
    (["a", ""], "prompt[1] is empty"),
    ([[1, 2], []], "prompt[1] is empty"),
    ([[1, 2], [3, 10**6]], "prompt[1]: token id 1000000 is out of vocabulary"),
    ([[1, 2], [4] * (MAX_LEN + 1)], f"prompt[1]: the prompt (length {MAX_LEN + 1}) is longer than the maximum"),
])
def test_empty_or_bad_prompts_of_a_list_are_named(server, prompt, match):
    assert match in error_message(post(server, "completions", {"prompt": prompt, "max_tokens": 1}))


# ---- the context length ---------------------------------------------------------------------------

def test_max_tokens_beyond_the_context_is_a_400(server):
    message = error_message(post(server, "completions", {"prompt": [5] * 200, "max_tokens": 100}))
    assert message == (f"This model's maximum context length is {MAX_LEN} tokens, but this request asks for 300 "
                       "tokens (200 in the prompt, 100 in the completion): shorten the prompt or lower max_tokens "
                       "to at most 56")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_beyond_the_context_is_a_400(server, field):
    for stream in (False, True):
        r = post(server, "chat/completions", {"messages": MESSAGES, field: MAX_LEN, "stream": stream})
        match = re.fullmatch(rf"This model's maximum context length is {MAX_LEN} tokens, but this request asks for "
                             rf"(\d+) tokens \((\d+) in the messages, {MAX_LEN} in the completion\): shorten the "
                             rf"messages or lower {field} to at most (\d+)", error_message(r))
        assert match, r.text
        total, in_prompt, room = map(int, match.groups())
        assert total == in_prompt + MAX_LEN and room == MAX_LEN - in_prompt and 0 < in_prompt < 50


def test_a_prompt_longer_than_the_context_names_both_lengths(server):
    message = error_message(post(server, "completions", {"prompt": [5] * (MAX_LEN + 44)}))
    assert f"length {MAX_LEN + 44}" in message and f"max_model_len={MAX_LEN}" in message


def test_what_fits_and_an_unset_max_tokens_are_served(server):
    exact = post(server, "completions", {"prompt": [5] * (MAX_LEN - 2), "max_tokens": 2, "ignore_eos": True})
    assert exact.status_code == 200, exact.text
    assert exact.json()["usage"]["completion_tokens"] == 2
    # Unset: OpenAI's default of 16 is capped to the 2 tokens that fit, as before.
    capped = post(server, "completions", {"prompt": [5] * (MAX_LEN - 2), "ignore_eos": True})
    assert capped.status_code == 200, capped.text
    assert capped.json()["usage"]["completion_tokens"] == 2
    chat = post(server, "chat/completions", {"messages": MESSAGES, "max_tokens": None, "max_completion_tokens": 3})
    assert chat.status_code == 200, chat.text


# ---- vLLM's token controls over HTTP ------------------------------------------------------------

def _completion_ids(server, body: dict) -> list[str]:
    r = post(server, "completions", {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                     "logprobs": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_logit_bias_allowed_token_ids_and_truncation_reach_the_sampler(server, model_dir):
    from tokenizers import Tokenizer
    piece = Tokenizer.from_file(f"{model_dir}/tokenizer.json").id_to_token
    plain = _completion_ids(server, {})
    forced = _completion_ids(server, {"logit_bias": {"42": 100}})  # OpenAI's form: string keys
    assert forced == [piece(42)] * 6 and forced != plain
    allowed = _completion_ids(server, {"allowed_token_ids": [11, 12], "temperature": 1.0, "seed": 3})
    assert len(allowed) == 6 and set(allowed) <= {piece(11), piece(12)}
    # a prompt longer than the context runs when cut to fit; the same ids as the cut prompt
    long_prompt = list(range(1, MAX_LEN + 40))
    r = post(server, "completions", {"prompt": long_prompt, "max_tokens": 3, "temperature": 0,
                                     "truncate_prompt_tokens": 100})
    cut = post(server, "completions", {"prompt": long_prompt[-100:], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
    assert r.json()["choices"][0]["text"] == cut.json()["choices"][0]["text"]


@pytest.mark.parametrize("body,match", [({"logit_bias": {"x": 1}}, "logit_bias: its keys are token ids"),
                                        ({"logit_bias": {"10000000": 1}}, "logit_bias: token id 10000000 is out"),
                                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")])
def test_bad_token_controls_are_a_400(server, body, match):
    assert match in error_message(post(server, "completions", {"prompt": "hi", "max_tokens": 2, **body}))
