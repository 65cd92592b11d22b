"""The built-in tiny-qwen3-moe ships a ChatML chat template (and ChatML's special tokens), so that
LLM.chat works on it, and ends a sequence at <|im_end|> as at <|endoftext|> (generation_config.json
lists both); a folder made before it had these gets them on next use."""
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


@pytest.mark.parametrize("old_files", [
    {"tokenizer_config.json": {"eos_token": "<|endoftext|>"}, "generation_config.json": {"eos_token_id": 0}},
    {"generation_config.json": {"eos_token_id": 0}},  # a template, but <|endoftext|> the only EOS
])
def test_a_folder_made_without_a_template_gets_one(tmp_path, monkeypatch, old_files):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path))
    path = ensure_tiny_model("tiny-qwen3-moe")
    for name, content in old_files.items():  # what earlier versions wrote
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f)
    weights = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert ensure_tiny_model("tiny-qwen3-moe") == path
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [0, _im_end_id(path)]
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == weights  # the weights stay


def _im_end_id(path: str) -> int:
    from moe.engine.tokenizer import Tokenizer

    return Tokenizer(path).backend.token_to_id("<|im_end|>")


def test_im_end_and_endoftext_both_end_a_sequence(tiny):
    """generation_config.json's eos_token_id is a list, [<|endoftext|>, <|im_end|>], as in Qwen's chat
    checkpoints: the engine stops at either (finish_reason "stop", stop_reason None, the EOS id kept in
    token_ids and out of the text), and ignore_eos goes past both. A logit bias makes the EOS certain."""
    from moe import LLM, SamplingParams

    with open(os.path.join(tiny, "generation_config.json")) as f:
        eos_ids = json.load(f)["eos_token_id"]
    im_end = _im_end_id(tiny)
    assert eos_ids == [0, im_end] and im_end == 511  # the last id of the 512-token vocabulary
    with LLM(tiny, device="cpu", max_model_len=128, kv_cache_memory_bytes=8 << 20) as llm:
        assert llm.llm_engine.eos_token_ids == (0, im_end)
        for eos in eos_ids:
            params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={eos: 100.0})
            out = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]
            assert (out.token_ids, out.finish_reason, out.stop_reason, out.text) == ([eos], "stop", None, "")
            ignoring = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={eos: 100.0}, ignore_eos=True)
            out = llm.generate(["Hello there"], ignoring, use_tqdm=False)[0].outputs[0]
            assert out.token_ids == [eos] * 6 and out.finish_reason == "length"
        # A chat reply ends at its <|im_end|>, as the template closes every message.
        reply = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, logit_bias={im_end: 100.0}),
                         use_tqdm=False)[0].outputs[0]
        assert reply.token_ids == [im_end] and reply.finish_reason == "stop" and reply.text == ""


def test_a_model_without_a_template_still_says_so(tiny, tmp_path):
    import shutil

    from moe import LLM

    bare = shutil.copytree(tiny, tmp_path / "bare")  # a copy without the template, built here
    with open(bare / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    with LLM(str(bare), device="cpu", max_model_len=64, kv_cache_memory_bytes=8 << 20) as llm:
        with pytest.raises(ValueError, match="has no chat template"):
            llm.chat(MESSAGES, use_tqdm=False)
