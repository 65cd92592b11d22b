"""Recorded conversations as benchmark requests, with vLLM's flags and rules, for `moe bench
throughput` and `moe bench serve`.

ShareGPT (`--dataset-name sharegpt --dataset-path FILE`): a JSON list of entries whose
"conversations" hold turns ({"from": ..., "value": text}); the first turn of each entry with at least
two is the prompt, and the second's token count the output length (or a fixed one: throughput's
--output-len, serve's --sharegpt-output-len). As in vLLM: the entries are shuffled by
random.Random(seed) (as vLLM's seeded shuffle orders them), then taken in order, skipping any
whose prompt has fewer than 4 tokens or more than 1024, whose output has fewer than 4 (not checked
with a fixed length), or whose prompt and output exceed 2048 together; when fewer than
--num-prompts pass, random ones of them are repeated to fill up (--no-oversample: not).
The real distribution of lengths (many short prompts, long answers) is the workload most vLLM
users benchmark with (`ShareGPT_V3_unfiltered_cleaned_split.json` of the Hugging Face hub).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

DATASETS = ("random", "sharegpt")
# vLLM's pruning rule for ShareGPT: tokens of prompt and output.
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass
class DatasetRequest:
    prompt: str
    prompt_len: int  # tokens, as the tokenizer encodes the prompt
    output_len: int  # tokens asked for (max_tokens, ignore_eos)


def check_dataset_args(name: str, path: str | None) -> None:
    """A dataset file goes with a named dataset, and a named dataset needs its file (vLLM's rule)."""
    if name not in DATASETS:
        raise ValueError(f"--dataset-name must be one of {', '.join(DATASETS)}, got {name!r}")
    if name == "random" and path is not None:
        raise ValueError(f"--dataset-path {path} is for a dataset file: pass --dataset-name sharegpt "
                         "(the random dataset reads none)")
    if name != "random" and path is None:
        raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")


def load_sharegpt(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of each entry with at least two turns, in the file's order."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the ShareGPT file {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a ShareGPT JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of conversations (ShareGPT's layout), "
                         f"got a {type(data).__name__}")
    pairs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        try:
            first, second = turns[0]["value"], turns[1]["value"]
        except (TypeError, KeyError):
            raise ValueError(f"{path}: entry {i} has turns without a 'value'") from None
        if not isinstance(first, str) or not isinstance(second, str):
            raise ValueError(f"{path}: entry {i} has a turn whose 'value' is not text")
        pairs.append((first, second))
    return pairs


def is_valid_lengths(prompt_len: int, output_len: int, check_output: bool = True) -> bool:
    """vLLM's pruning rule: prompt 4..1024 tokens, output >= 4 (when it is the dataset's), 2048 together."""
    return (MIN_LEN <= prompt_len <= MAX_PROMPT_LEN and (output_len >= MIN_LEN or not check_output)
            and prompt_len + output_len <= MAX_TOTAL_LEN)


def sharegpt_requests(path: str, num_prompts: int, tokenizer, seed: int = 0, output_len: int | None = None,
                      oversample: bool = True, pairs: list[tuple[str, str]] | None = None) -> list[DatasetRequest]:
    """num_prompts requests from a ShareGPT file (the module's rules); `tokenizer` has encode(text)
    -> ids. output_len: a fixed output length instead of each answer's. pairs: the file's
    load_sharegpt, when already read (a whole ShareGPT file takes seconds to parse)."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if output_len is not None and output_len < 1:
        raise ValueError(f"the fixed output length must be >= 1, got {output_len}")
    pairs = list(load_sharegpt(path) if pairs is None else pairs)
    rng = random.Random(seed)
    rng.shuffle(pairs)
    requests: list[DatasetRequest] = []
    for prompt, answer in pairs:
        if len(requests) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt))
        n_out = output_len if output_len is not None else len(tokenizer.encode(answer))
        if is_valid_lengths(prompt_len, n_out, check_output=output_len is None):
            requests.append(DatasetRequest(prompt, prompt_len, n_out))
    if not requests:
        raise ValueError(f"no conversation of {path} ({len(pairs)} with two turns or more) has a prompt of "
                         f"{MIN_LEN}..{MAX_PROMPT_LEN} tokens and an answer of {MIN_LEN} or more, "
                         f"{MAX_TOTAL_LEN} together")
    if oversample and len(requests) < num_prompts:
        requests += [rng.choice(requests) for _ in range(num_prompts - len(requests))]
    return requests
