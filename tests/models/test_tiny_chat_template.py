"""The built-in tiny-qwen3-moe ships a ChatML chat template (and ChatML's special tokens), so that
LLM.chat works on it; a folder made before it had one gets it on next use."""
from __future__ import annotations

import json
import os

import pytest

from models.tiny import CHATML_TOKENS, ensure_tiny_model

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return ensure_tiny_model("tiny-qwen3-moe")


def test_chat_renders_chatml_with_single_special_tokens(tiny):
    from moe import LLM, SamplingParams

    with LLM(tiny, device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20) as llm:
        out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        tok = llm.get_tokenizer()
    want = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert out.prompt == want
    assert out.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    start, end = (tok.backend.token_to_id(t) for t in CHATML_TOKENS)
    assert out.prompt_token_ids.count(start) == 3 and out.prompt_token_ids.count(end) == 2
    assert len(out.outputs[0].token_ids) == 3


def test_transformers_renders_the_same_tokens(tiny):
    transformers = pytest.importorskip("transformers")

    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    from moe.engine.chat_template import ChatTemplate
    from moe.engine.tokenizer import Tokenizer

    text = ChatTemplate.load(tiny).render(MESSAGES, add_generation_prompt=True)
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert list(ids) == Tokenizer(tiny).encode(text, add_special_tokens=False)


def test_a_folder_made_without_a_template_gets_one(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path))
    path = ensure_tiny_model("tiny-qwen3-moe")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:  # what earlier versions wrote
        json.dump({"eos_token": "<|endoftext|>"}, f)
    weights = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert ensure_tiny_model("tiny-qwen3-moe") == path
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == weights  # the weights stay


def test_a_model_without_a_template_still_says_so(tiny, tmp_path):
    import shutil

    from moe import LLM

    bare = shutil.copytree(tiny, tmp_path / "bare")  # a copy without the template, built here
    with open(bare / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    with LLM(str(bare), device="cpu", max_model_len=64, kv_cache_memory_bytes=8 << 20) as llm:
        with pytest.raises(ValueError, match="has no chat template"):
            llm.chat(MESSAGES, use_tqdm=False)
