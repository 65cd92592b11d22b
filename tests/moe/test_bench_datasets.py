"""moe/bench/datasets.py: ShareGPT files as benchmark requests by vLLM's rules (which entries, in
which order, what lengths), its errors, and `moe bench throughput --dataset-name sharegpt` on the
built-in tiny model."""
from __future__ import annotations

import json
import random

import pytest

from moe.bench import datasets, throughput
from moe.bench.datasets import MAX_PROMPT_LEN, MAX_TOTAL_LEN, MIN_LEN, sharegpt_requests


class WordTokenizer:
    """One token per word: lengths the test can set exactly."""

    def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def conversation(prompt: str, answer: str, extra_turns: int = 0) -> dict:
    turns = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    return {"id": prompt[:8], "conversations": turns + [{"from": "human", "value": "more"}] * extra_turns}


def write(tmp_path, data) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_rules_pick_entries_by_their_token_lengths(tmp_path):
    valid = [(MIN_LEN, MIN_LEN), (MAX_PROMPT_LEN, MAX_TOTAL_LEN - MAX_PROMPT_LEN), (10, 20), (7, 5)]
    invalid = [(MIN_LEN - 1, 10), (MAX_PROMPT_LEN + 1, 10), (10, MIN_LEN - 1), (1000, MAX_TOTAL_LEN - 1000 + 1)]
    data = [conversation(words(p, f"v{i}_"), words(o)) for i, (p, o) in enumerate(valid)]
    data += [conversation(words(p, f"x{i}_"), words(o)) for i, (p, o) in enumerate(invalid)]
    data += [{"id": "one turn", "conversations": [{"from": "human", "value": words(10)}]}, {"id": "no turns"}]
    got = sharegpt_requests(write(tmp_path, data), 100, WordTokenizer(), seed=0, oversample=False)
    assert sorted((r.prompt_len, r.output_len) for r in got) == sorted(valid)
    assert all(r.prompt.startswith("v") for r in got)
    # a fixed output length: the answers' lengths no longer count, the total still does
    got = sharegpt_requests(write(tmp_path, data), 100, WordTokenizer(), output_len=2, oversample=False)
    assert sorted(r.prompt_len for r in got) == sorted([p for p, _ in valid] + [10, 1000])  # their short answers
    assert all(r.output_len == 2 for r in got)


def test_order_is_a_seeded_shuffle_of_the_two_turn_entries(tmp_path):
    data = [conversation(words(5, f"p{i}_"), words(6)) for i in range(30)]
    data.insert(3, {"id": "short", "conversations": []})  # dropped before the shuffle, as vLLM drops it
    path = write(tmp_path, data)
    prompts = [d["conversations"][0]["value"] for d in data if len(d["conversations"]) >= 2]
    for seed in (0, 7):
        want = list(prompts)
        random.Random(seed).shuffle(want)
        got = sharegpt_requests(path, 12, WordTokenizer(), seed=seed)
        assert [r.prompt for r in got] == want[:12]
    assert [r.prompt for r in sharegpt_requests(path, 12, WordTokenizer(), seed=0)] != \
        [r.prompt for r in sharegpt_requests(path, 12, WordTokenizer(), seed=7)]


def test_too_few_entries_are_repeated_unless_told_not_to(tmp_path):
    path = write(tmp_path, [conversation(words(5, f"p{i}_"), words(6)) for i in range(3)])
    got = sharegpt_requests(path, 10, WordTokenizer(), seed=1)
    assert len(got) == 10 and len({r.prompt for r in got}) == 3
    assert len(sharegpt_requests(path, 10, WordTokenizer(), seed=1, oversample=False)) == 3


@pytest.mark.parametrize("content, says", [
    (None, "cannot read the ShareGPT file"),
    ("{not json", "is not a ShareGPT JSON file"),
    ('{"conversations": []}', "must hold a JSON list of conversations"),
    ('[{"conversations": [{"from": "human"}, {"from": "gpt"}]}]', "entry 0 has turns without a 'value'"),
    ('[{"conversations": [{"value": 1}, {"value": "a b c d"}]}]', "entry 0 has a turn whose 'value' is not text"),
    (json.dumps([conversation("hi", "a b c d e")]), "no conversation of"),
])
def test_bad_files_get_errors_that_name_them(tmp_path, content, says):
    path = tmp_path / "data.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=says) as e:
        sharegpt_requests(str(path), 4, WordTokenizer())
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name, path, says", [
    ("random", "x.json", "pass --dataset-name sharegpt"),
    ("sharegpt", None, "needs --dataset-path"),
    ("sonnet", None, "must be one of random, sharegpt"),
])
def test_dataset_flags_go_together(name, path, says):
    with pytest.raises(ValueError, match=says):
        datasets.check_dataset_args(name, path)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_throughput_on_sharegpt_runs_each_prompt_for_its_answers_length(cache_dir):
    from moe.engine.tokenizer import load_tokenizer
    from models.tiny import ensure_tiny_model

    data = [conversation(f"Question {i}: " + "tell me a story " * (1 + i % 4), "Once upon a time " * (1 + i % 3))
            for i in range(9)]
    path = write(cache_dir, data)
    engine = {"model": "tiny-qwen3-moe", "device": "cpu", "dtype": "float32", "max_num_seqs": 4}
    r = throughput.run_throughput(engine, None, None, 6, seed=2, dataset_name="sharegpt", dataset_path=path)
    tok = load_tokenizer(ensure_tiny_model("tiny-qwen3-moe"))
    want = sharegpt_requests(path, 6, tok, seed=2)
    w = r["workload"]
    assert r["num_requests"] == 6 and w["dataset_name"] == "sharegpt" and w["dataset_path"] == path
    assert w["input_lens"] == [q.prompt_len for q in want] and w["output_lens"] == [q.output_len for q in want]
    assert len(set(w["output_lens"])) > 1
    assert r["total_prompt_tokens"] == sum(w["input_lens"])
    assert r["total_output_tokens"] == sum(w["output_lens"])  # ignore_eos: each answer's length exactly
    fixed = throughput.run_throughput(engine, None, 3, 4, seed=2, dataset_name="sharegpt", dataset_path=path)
    assert fixed["workload"]["output_lens"] == [3] * 4 and fixed["total_output_tokens"] == 12


def test_throughput_refuses_a_bad_file_before_the_engine_starts(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a ShareGPT JSON file"):  # no model at this path: not loaded
        throughput.run_throughput({"model": "/nonexistent"}, None, None, 2, dataset_name="sharegpt",
                                  dataset_path=str(bad))


@pytest.mark.parametrize("argv, says", [
    (["--dataset-path", "x.json"], "pass --dataset-name sharegpt"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
])
def test_throughput_command_line_refuses_a_lone_dataset_flag(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        throughput.main(argv + ["--device", "cpu"])
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("backend, endpoint, want", [
    ("vllm", None, "/v1/completions"), ("openai", "/v1/completions", "/v1/completions"),
    ("openai-chat", None, "/v1/chat/completions"), ("openai-chat", "/v2/chat/completions", "/v2/chat/completions"),
    ("openai-chat", "/v1/completions", "ends with chat/completions"),
    ("vllm", "/v1/chat/completions", "pass --backend openai-chat"),
])
def test_bench_serve_backend_picks_its_endpoint(backend, endpoint, want):
    from moe.bench import serve

    args = serve.build_parser().parse_args(["--backend", backend] + (["--endpoint", endpoint] if endpoint else []))
    if want.startswith("/"):
        assert serve.resolve_endpoint(args) == want
    else:
        with pytest.raises(ValueError, match=want):
            serve.resolve_endpoint(args)
