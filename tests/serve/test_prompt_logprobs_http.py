"""/v1/completions with vLLM's `prompt_logprobs` and with `echo` + `logprobs`, against the offline
LLM on the same checkpoint; and the names of completions' logprob tokens, which must keep tokens
that decode to the same text apart (a `top_logprobs` dict would keep one of them)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from moe import SamplingParams
from moe.outputs import Logprob
from tests.serve.helpers import MODEL_NAME, ServerProcess, headers

PROMPT_IDS = [5, 60, 7, 81, 9, 100, 11, 12, 130, 14, 15, 160, 17, 18, 19, 200, 21, 22, 23]  # > one 16-token block


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # A 16-token budget: the prompt reaches the engine in two chunks.
    srv = ServerProcess(model_dir, str(tmp_path_factory.mktemp("log") / "serve.log"),
                        extra=["--max-num-batched-tokens", "16", "--enable-prefix-caching"])
    yield srv
    srv.stop()


def post(server, body: dict, stream: bool = False):
    body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 3, "ignore_eos": True, **body}
    if stream:
        return httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, headers=headers(),
                            timeout=60)
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers(), timeout=60)


@pytest.fixture(scope="module")
def offline(llm):
    return llm.generate({"prompt_token_ids": PROMPT_IDS},
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2),
                        use_tqdm=False)[0]


def test_prompt_logprobs_in_each_choice(server, offline):
    for _ in range(2):  # the second time the prompt is in the prefix cache: computed again all the same
        r = post(server, {"prompt": PROMPT_IDS, "prompt_logprobs": 2, "n": 2, "temperature": 0.7, "seed": 1})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 2
        for c in choices:
            got = c["prompt_logprobs"]
            assert len(got) == len(PROMPT_IDS) and got[0] is None
            for entry, want, tok in zip(got[1:], offline.prompt_logprobs[1:], PROMPT_IDS[1:]):
                assert list(entry)[0] == str(tok), "the prompt token first, keyed by its id"
                assert set(entry) == {str(t) for t in want}
                for t, lp in want.items():
                    assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
                    assert entry[str(t)]["rank"] == lp.rank and entry[str(t)]["decoded_token"] == lp.decoded_token
    plain = post(server, {"prompt": PROMPT_IDS}).json()["choices"][0]
    assert plain["prompt_logprobs"] is None


def test_echo_with_logprobs_scores_the_prompt(server, offline, llm):
    """vLLM's echo: the prompt's tokens come first in logprobs, the first with null logprob and
    alternatives, the others with the prompt logprobs (logprobs alternatives each)."""
    r = post(server, {"prompt": PROMPT_IDS, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    lps = c["logprobs"]
    out = offline.outputs[0]
    P = len(PROMPT_IDS)
    assert len(lps["tokens"]) == P + len(out.token_ids)
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    want = [e[t].logprob for e, t in zip(offline.prompt_logprobs[1:], PROMPT_IDS[1:])]
    want += [e[t].logprob for e, t in zip(out.logprobs, out.token_ids)]
    assert lps["token_logprobs"][1:] == pytest.approx(want, abs=1e-5)
    assert all(len(top) == 2 for top in lps["top_logprobs"][1:])
    assert lps["text_offset"][0] == 0 and c["text"].endswith(out.text)
    assert c["prompt_logprobs"] is not None and len(c["prompt_logprobs"]) == P
    # streamed: the first chunk of the choice carries the echoed prompt's logprobs
    with post(server, {"prompt": PROMPT_IDS, "echo": True, "logprobs": 2}, stream=True) as s:
        assert s.status_code == 200
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [lp for e in events for ch in e["choices"] for lp in ch["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want, abs=1e-5)
    # echo without logprobs computes nothing of the prompt
    assert post(server, {"prompt": PROMPT_IDS, "echo": True}).json()["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("body,match", [
    ({"prompt_logprobs": -1}, "prompt_logprobs=-1: must be a non-negative integer"),
    ({"prompt_logprobs": 50}, "prompt_logprobs=50: at most max_logprobs=20"),
    ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_a_400(server, body, match):
    r = post(server, {"prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert match in r.json()["error"]["message"]


# ---- token names of completions' logprobs -----------------------------------------------------

class _FakeTokenizer:
    """decode_token / token_bytes of a made-up vocabulary."""

    def __init__(self, texts: dict[int, str], raw: dict[int, bytes]) -> None:
        self.texts, self.raw = texts, raw

    def decode_token(self, t: int) -> str:
        return self.texts[t]

    def token_bytes(self, t: int) -> bytes | None:
        return self.raw.get(t)


def _completion_logprobs(tokenizer, token_ids, entries, k):
    from moe.entrypoints.serve.handlers import CompletionHandler
    handler = CompletionHandler(SimpleNamespace(info=SimpleNamespace(tokenizer=tokenizer)), MODEL_NAME)
    return handler._logprobs(SimpleNamespace(logprobs=k), token_ids, entries, 0)


def test_colliding_token_texts_stay_distinct():
    """Partial UTF-8 bytes (all decoded "\\ufffd") are named by their bytes, OpenAI's legacy
    "bytes:\\xe2" form; equal names otherwise get vLLM's "token_id:<id>", the chosen token keeping
    its plain name; a real U+FFFD character stays itself; chat's list form names tokens plainly."""
    tok = _FakeTokenizer({1: "\ufffd", 2: "\ufffd", 3: "\ufffd", 4: "a", 5: "a", 6: "\ufffd"},
                         {1: b"\xe2", 2: b"\xe2\x80", 3: b"\x99", 6: "\ufffd".encode()})
    entry = {1: Logprob(-0.5, 1), 2: Logprob(-1.0, 2), 3: Logprob(-1.5, 3), 6: Logprob(-2.0, 4)}
    lps = _completion_logprobs(tok, [1], [entry], 4)
    assert lps["tokens"] == ["bytes:\\xe2"]
    assert lps["top_logprobs"] == [{"bytes:\\xe2": -0.5, "bytes:\\xe2\\x80": -1.0, "bytes:\\x99": -1.5,
                                    "\ufffd": -2.0}]
    assert lps["text_offset"] == [0]
    entry = {5: Logprob(-0.1, 1), 4: Logprob(-0.7, 2)}  # the chosen token 4 is second in rank
    lps = _completion_logprobs(tok, [4, 4], [entry, None], 2)
    assert lps["tokens"] == ["a", "a"] and lps["top_logprobs"] == [{"token_id:5": -0.1, "a": -0.7}, None]
    assert lps["token_logprobs"] == [-0.7, None] and lps["text_offset"] == [0, 1]


def test_byte_level_tokens_of_the_tiny_tokenizer(model_dir):
    """On a real byte-level BPE vocabulary: the tokens of single bytes >= 0x80 and of partial
    characters all decode to "\\ufffd", and each keeps a name of its own."""
    from moe.engine.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    ids = [t for t in range(tok.vocab_size) if tok.decode_token(t) == "\ufffd"]
    assert len(ids) > 128 and sum(len(tok.token_bytes(t)) == 1 for t in ids) == 128
    entry = {t: Logprob(-1.0 - i, i + 1) for i, t in enumerate(ids)}
    lps = _completion_logprobs(tok, [ids[0]], [entry], len(ids))
    names = lps["top_logprobs"][0]
    assert len(names) == len(ids) and all(k.startswith("bytes:\\x") for k in names)
    assert names["bytes:" + "".join(f"\\x{b:02x}" for b in tok.token_bytes(ids[-1]))] == -len(ids)
    plain = tok.encode("hello world", add_special_tokens=False)
    assert [tok.token_bytes(t) for t in plain] == [tok.decode_token(t).encode() for t in plain]
