"""Incremental detokenisation equals a full decode, across multi-byte characters."""
from __future__ import annotations

import pytest

from models.tiny import build_tokenizer
from moe.engine.detokenizer import IncrementalDetokenizer
from moe.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(512).save(str(path / "tokenizer.json"))
    return Tokenizer(str(path))


@pytest.mark.parametrize("text", ["Hello, world!", "東京 and 日本語 😀🚀 café", "naïve привет こんにちは"])
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Prompt: ")
    detok = IncrementalDetokenizer(tokenizer, prompt, [], False)
    for t in ids:  # one token at a time, as generation produces them
        assert detok.update([t]) is None
        assert "\ufffd" not in detok.output_text
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids) == text


def test_split_byte_tokens_wait_for_whole_character(tokenizer):
    # Byte-level tokens of one 4-byte emoji, fed one at a time: nothing shows until it is whole.
    emoji = "🦀"  # not in the training corpus, so it stays as separate byte tokens
    ids = tokenizer.encode(emoji)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [], [], False)
    for t in ids[:-1]:
        detok.update([t])
        assert detok.output_text == ""
    detok.update(ids[-1:])
    assert detok.output_text == emoji


def test_stop_string_truncates(tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps")
    detok = IncrementalDetokenizer(tokenizer, [], ["brown"], False)
    hit = None
    for t in ids:
        hit = detok.update([t])
        if hit:
            break
    assert hit == "brown" and detok.output_text == "The quick "
    detok = IncrementalDetokenizer(tokenizer, [], ["brown"], True)
    for t in ids:
        if detok.update([t]):
            break
    assert detok.output_text == "The quick brown"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_read_at_the_end_equals_text_read_along_the_way(tokenizer, skip_special_tokens):
    """Without stop strings the text is made by one decode when read at the end; read during
    generation, the tokens go through the stream: both equal a full decode, on random ids (cut
    characters, special tokens, U+FFFD included)."""
    import random
    rng = random.Random(0)
    vocab = tokenizer.backend.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        at_end = IncrementalDetokenizer(tokenizer, [], [], False, skip_special_tokens)
        along = IncrementalDetokenizer(tokenizer, [], [], False, skip_special_tokens)
        cut = rng.randrange(len(ids) + 1)
        at_end.update(ids[:cut])
        at_end.update(ids[cut:])
        for t in ids:
            along.update([t])
            along.output_text  # a mid-generation read streams what came so far
        at_end.flush()
        along.flush()
        want = tokenizer.decode(ids, skip_special_tokens)
        assert at_end.output_text == want and along.output_text == want
