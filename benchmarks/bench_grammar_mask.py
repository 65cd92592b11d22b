"""Grammar-mask cost on the host: the time to fill one step's bitmask for a batch of structured
requests (and to consume their sampled tokens), for llguidance (the engine's library) and, when
it imports, xgrammar (never a dependency: install it apart, e.g. `pip install --target /tmp/xg
--no-deps xgrammar apache-tvm-ffi` and run with PYTHONPATH=/tmp/xg).

    python benchmarks/bench_grammar_mask.py --out benchmarks/results/s15/grammar_mask_cpu.json

The vocabulary is a synthetic 150k-token byte-level BPE, trained here in ~10 s with the `tokenizers`
library on made-up words (Qwen-sized, as real checkpoints cannot be downloaded). Each of the B
requests follows its own random document valid under a JSON schema of five fields (string, integer
in a range, boolean, array of enums, optional number), so the matchers sit in different states;
a second schema bounds the string's length (maxLength), which costs llguidance much more. Per step the
bench times one batched fill of the [B, ceil(V / 32)] int32 bitmask (llguidance's LLExecutor /
xgrammar's BatchGrammarMatcher, all threads) and the batched consumption of each request's next
token; it reports medians over the steps, in microseconds per request per step and milliseconds
per step, for B = 1, 32, 256. Self-contained: no model, no engine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "violet"]}, "maxItems": 4},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "active", "tags"],
    "additionalProperties": False,
}
# The same with a length bound on the string: llguidance then walks the whole token trie at every
# step inside the string (no precomputed slice applies), xgrammar does not; measured apart.
BOUNDED_SCHEMA = {**SCHEMA, "properties": {**SCHEMA["properties"], "name": {"type": "string", "maxLength": 24}}}
SCHEMAS = {"typical": SCHEMA, "string_maxLength": BOUNDED_SCHEMA}
BATCHES = (1, 32, 256)
VOCAB = 150_000
EOS = 0


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE (GPT-2 / Qwen style pre-tokenisation) trained on synthetic words, with
    JSON-ish punctuation and numbers in the text so that such tokens exist as in real vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"

    def word() -> str:
        return "".join(rng.choice(consonants) + rng.choice(vowels) + (rng.choice("nrstl") if rng.random() < 0.3 else "")
                       for _ in range(rng.randint(1, 4)))

    words = sorted({word() for _ in range(400_000)})
    rng.shuffle(words)

    def corpus():
        for i in range(0, len(words), 1000):
            chunk = words[i:i + 1000]
            yield (" ".join(w for w in chunk for _ in range(1 + i % 3)) + " " +
                   " ".join(w.capitalize() for w in chunk[:200]) +
                   f' {{"{chunk[0]}": {i}, "{chunk[1]}": [{i / 7:.3f}, true, null], "ok": false}}\n')

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def documents(n: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz "
    docs = []
    for _ in range(n):
        doc = {"name": "".join(rng.choice(letters) for _ in range(rng.randint(3, 20))).strip() or "x",
               "age": rng.randint(0, 150), "active": rng.random() < 0.5,
               "tags": rng.sample(["red", "green", "blue", "violet"], rng.randint(0, 3))}
        if rng.random() < 0.5:
            doc["score"] = round(rng.uniform(-100, 100), rng.randint(0, 4))
        docs.append(json.dumps(doc, separators=(",", ":")))
    return docs


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def run_llguidance(tok, docs_ids: list[list[int]], batches, schema: dict) -> dict:
    import llguidance as llg
    from llguidance.numpy import consume_token_par, fill_next_token_bitmask_par

    t0 = time.perf_counter()
    ll_tok = llg.LLTokenizer(tok.to_str(), n_vocab=VOCAB, eos_token=EOS)
    tokenizer_s = time.perf_counter() - t0
    grammar = llg.LLMatcher.grammar_from_json_schema(schema)
    t0 = time.perf_counter()
    template = llg.LLMatcher(ll_tok, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    assert not template.is_error(), template.get_error()
    executor = llg.LLExecutor()
    rows = []
    for B in batches:
        matchers = [template.deep_copy() for _ in range(B)]
        docs = docs_ids[:B]
        steps = min(len(d) for d in docs)
        bitmask = np.empty((B, (VOCAB + 31) // 32), dtype=np.int32)
        fill, consume = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
            fill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ok = consume_token_par(executor, [(m, d[s]) for m, d in zip(matchers, docs)])
            consume.append(time.perf_counter() - t0)
            assert all(ok), [m.get_error() for m in matchers if m.is_error()][:1]
        rows.append(_row("llguidance", _version("llguidance"), B, steps, fill, consume))
    return {"rows": rows, "tokenizer_build_ms": tokenizer_s * 1e3, "schema_compile_ms": compile_s * 1e3}


def run_xgrammar(tok, docs_ids: list[list[int]], batches, schema: dict) -> dict | None:
    try:
        import xgrammar as xgr
    except Exception as e:  # noqa: BLE001 - optional contender
        print(f"xgrammar not importable ({type(e).__name__}: {e}); skipped", file=sys.stderr)
        return None
    vocab = tok.get_vocab(with_added_tokens=True)
    encoded = [""] * VOCAB
    for text, i in vocab.items():
        encoded[i] = text
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
    tokenizer_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(schema))
    compile_s = time.perf_counter() - t0
    batch_matcher = xgr.BatchGrammarMatcher()
    rows = []
    for B in batches:
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(B)]
        docs = docs_ids[:B]
        steps = min(len(d) for d in docs)
        bitmask = xgr.allocate_token_bitmask(B, VOCAB)
        fill, consume = [], []
        for s in range(steps):
            t0 = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            fill.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ok = xgr.BatchGrammarMatcher.batch_accept_token(matchers, [d[s] for d in docs])
            consume.append(time.perf_counter() - t0)
            assert all(ok), f"xgrammar refused a token at step {s}"
        rows.append(_row("xgrammar", _version("xgrammar"), B, steps, fill, consume))
    return {"rows": rows, "tokenizer_build_ms": tokenizer_s * 1e3, "schema_compile_ms": compile_s * 1e3}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _row(library: str, version: str, B: int, steps: int, fill: list[float], consume: list[float]) -> dict:
    return {"library": library, "version": version, "batch": B, "steps": steps,
            "fill_us_per_request": round(_median_us(fill) / B, 2), "fill_ms_per_step": round(_median_us(fill) / 1e3, 3),
            "fill_p90_ms_per_step": round(float(np.percentile(fill, 90)) * 1e3, 3),
            "consume_us_per_request": round(_median_us(consume) / B, 2),
            "consume_ms_per_step": round(_median_us(consume) / 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON result here too")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    tok = build_tokenizer(VOCAB)
    build_s = time.perf_counter() - t0
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    docs_ids = [tok.encode(d).ids for d in documents(max(batches))]
    result = {
        "bench": "grammar_mask", "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "vocab_size": VOCAB,
        "tokenizer": "synthetic byte-level BPE trained with tokenizers on made-up words "
                     f"({build_s:.1f} s; tokens per document: median {statistics.median(map(len, docs_ids)):.0f})",
        "schemas": SCHEMAS,
        "libraries": {},
    }
    for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
        for schema_name, schema in SCHEMAS.items():
            got = fn(tok, docs_ids, batches, schema)
            if got is not None:
                result["libraries"].setdefault(name, {})[schema_name] = got
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
