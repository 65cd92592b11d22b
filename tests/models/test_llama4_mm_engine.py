"""Images end to end: `LLM.generate` / `LLM.chat` with images on a tiny random multimodal Llama-4
checkpoint against transformers' Llama4ForConditionalGeneration, greedy tokens and logprobs.

The reference is fed the prompt ids and pixel values our input side made (our processor is checked
against transformers' own in test_llama4_processor.py); it recomputes the whole sequence at every
step, the images included. Budgets small enough to cut chunks through an image's tokens, batches
mixing text-only and image prompts, several images per prompt of different aspect ratios.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe import LLM, SamplingParams
from tests.factories_llama4_mm import TOKEN_IDS, data_url, make_llama4_mm_model, picture, save_llama4_mm_checkpoint

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def hf_mm():
    return make_llama4_mm_model(seed=3)


@pytest.fixture(scope="module")
def ckpt(hf_mm, tmp_path_factory):
    return save_llama4_mm_checkpoint(hf_mm, str(tmp_path_factory.mktemp("llama4_mm_engine")), shards=2)


def make_llm(ckpt: str, **kw) -> LLM:
    args = dict(dtype="float32", device="cpu", max_model_len=256, block_size=8, max_num_seqs=4,
                kv_cache_memory_bytes=1 << 24)
    args.update(kw)
    return LLM(ckpt, **args)


@pytest.fixture(scope="module")
def llm(ckpt):
    return make_llm(ckpt)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@torch.no_grad()
def hf_greedy(hf_mm, ids: list[int], pixel_values: torch.Tensor | None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, the whole sequence (and every image) recomputed per step."""
    ids, tokens, logprobs = list(ids), [], []
    for _ in range(MAX_TOKENS):
        kwargs = {} if pixel_values is None else {"pixel_values": pixel_values.float()}
        logits = hf_mm(input_ids=torch.tensor([ids]), **kwargs).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        ids.append(token)
    return tokens, logprobs


def reference(hf_mm, llm: LLM, prompt) -> tuple[list[int], list[float]]:
    p = llm.llm_engine.input.process_prompt(prompt)
    pixels = torch.cat([m.pixel_values for m in p.mm_items]) if p.mm_items else None
    return hf_greedy(hf_mm, p.prompt_token_ids, pixels)


def ours(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def assert_matches(hf_mm, llm: LLM, prompts: list) -> None:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        want_tokens, want_lps = reference(hf_mm, llm, prompt)
        got_tokens, got_lps = ours(out)
        assert got_tokens == want_tokens
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-4, rtol=0)


def image_prompt(text_before: str, images: list, text_after: str = " what is shown?") -> dict:
    placeholders = "<|image|>" * len(images)
    return {"prompt": f"<|header_start|>user<|header_end|>{text_before}{placeholders}{text_after}",
            "multi_modal_data": {"image": images if len(images) != 1 else images[0]}}


def test_one_image_matches_hf(hf_mm, llm):
    assert_matches(hf_mm, llm, [image_prompt("look:", [picture(90, 130, 0)])])


def test_two_images_of_different_aspect_ratios_match_hf(hf_mm, llm):
    prompt = {"prompt": "<|image|> the first, and then <|image|> the second",
              "multi_modal_data": {"image": [picture(150, 40, 1), picture(56, 56, 2)]}}
    assert_matches(hf_mm, llm, [prompt])


def test_batch_mixing_text_and_image_prompts_matches_hf(hf_mm, llm):
    prompts = ["a prompt of text only, a little longer than the others",
               image_prompt("one", [picture(30, 200, 4)]),
               {"prompt_token_ids": [1, 5, 6, 7, TOKEN_IDS["<|image|>"], 9, 10],
                "multi_modal_data": {"image": picture(120, 100, 5, mode="L")}},
               "short"]
    assert_matches(hf_mm, llm, prompts)


@pytest.mark.parametrize("budget", [8, 13])
def test_chunks_cutting_through_image_tokens_match_hf(hf_mm, ckpt, budget):
    """Token budgets far below an image's span: every image is split over several chunks (and the
    encoder cache, max(budget, largest image), holds one image at a time)."""
    small = make_llm(ckpt, max_num_batched_tokens=budget)
    prompts = [image_prompt("x", [picture(100, 170, 6), picture(60, 60, 7)]), image_prompt("y", [picture(80, 50, 8)])]
    assert_matches(hf_mm, small, prompts)
    small.shutdown()


def test_chat_with_image_parts_equals_generate(hf_mm, llm):
    image = picture(70, 110, 9)
    conversation = [{"role": "user", "content": [
        {"type": "text", "text": "Describe "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": " and "},
        {"type": "image_pil", "image_pil": picture(40, 40, 10)},
    ]}]
    chat_out = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    text = llm.llm_engine.input.render_chat([{"role": "user", "content": [
        {"type": "text", "text": "Describe "}, {"type": "image"}, {"type": "text", "text": " and "},
        {"type": "image"}]}])
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [image, picture(40, 40, 10)]}}
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]  # the same prompt: a prefix-cache hit
    assert again.num_cached_tokens > 0 and ours(again)[0] == ours(chat_out)[0]
    np.testing.assert_allclose(ours(again)[1], ours(chat_out)[1], atol=1e-5, rtol=0)
    assert ours(chat_out)[0] == reference(hf_mm, llm, prompt)[0]


def test_same_text_different_images_give_different_outputs(llm):
    a = llm.generate(image_prompt("z", [picture(56, 56, 11)]), GREEDY, use_tqdm=False)[0]
    b = llm.generate(image_prompt("z", [picture(56, 56, 12)]), GREEDY, use_tqdm=False)[0]
    assert ours(a)[1] != ours(b)[1]


# ---- bad input -------------------------------------------------------------------------------
def test_bad_images_get_clear_errors(llm):
    cases = [
        ({"prompt": "<|image|> hi", "multi_modal_data": {"image": b"not an image"}}, "image 0 of the prompt"),
        ({"prompt": "<|image|> hi", "multi_modal_data": {"image": "https://example.com/a.png"}}, "network"),
        ({"prompt": "<|image|> hi", "multi_modal_data": {"image": [picture(20, 20, 0)] * 2}}, "2"),
        ({"prompt": "hi", "multi_modal_data": {"image": picture(20, 20, 0)}}, "1"),
        ({"prompt": "<|image|> hi", "multi_modal_data": {"video": picture(20, 20, 0)}}, "unsupported modality"),
        ({"prompt": "<|image|> hi", "multi_modal_data": [picture(20, 20, 0)]}, "must be a dict"),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    # Nothing was queued by the failures: the engine still serves.
    assert not llm.llm_engine.has_unfinished_requests()
    assert_ok = llm.generate(image_prompt("ok", [picture(20, 20, 0)]), GREEDY, use_tqdm=False)[0]
    assert len(assert_ok.outputs[0].token_ids) == MAX_TOKENS


def test_limit_mm_per_prompt(ckpt):
    one = make_llm(ckpt, limit_mm_per_prompt={"image": 1})
    with pytest.raises(ValueError, match="more than limit_mm_per_prompt"):
        one.generate(image_prompt("two", [picture(20, 20, 0), picture(20, 20, 1)]), GREEDY, use_tqdm=False)
    one.shutdown()
    text_only = make_llm(ckpt, limit_mm_per_prompt='{"image": 0}')
    assert text_only.llm_engine.executor.model.vision_encoder is None  # the tower is not even loaded
    with pytest.raises(ValueError, match="takes no images"):
        text_only.generate(image_prompt("one", [picture(20, 20, 0)]), GREEDY, use_tqdm=False)
    text_only.shutdown()


def test_text_model_rejects_images(tmp_path):
    with pytest.raises(ValueError, match="takes no images"):
        LLM("tiny-qwen3-moe", device="cpu", limit_mm_per_prompt={"image": 1})
    text = LLM("tiny-qwen3-moe", device="cpu", kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="takes no images"):
        text.generate({"prompt": "hi", "multi_modal_data": {"image": picture(20, 20, 0)}}, use_tqdm=False)
    text.shutdown()


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_tensor_parallel_encoder_modes_match_one_process(ckpt, llm, mode):
    """TP=2 on the CPU (gloo workers): the same tokens and logprobs as one process, with the
    encoder's linears split ("weights") or its tiles split ("data"); a small budget cuts chunks
    through the images, and three tiles + one (odd) go through data mode's padding."""
    import os
    os.environ.setdefault("MOE_COLLECTIVE_TIMEOUT_S", "60")
    prompts = [image_prompt("a", [picture(100, 170, 6), picture(60, 60, 7)]), "text only",
               image_prompt("b", [picture(70, 40, 13)])]
    want = [ours(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with make_llm(ckpt, tensor_parallel_size=2, mm_encoder_tp_mode=mode, max_num_batched_tokens=16) as tp:
        got = [ours(o) for o in tp.generate(prompts, GREEDY, use_tqdm=False)]
    for (want_tokens, want_lps), (got_tokens, got_lps) in zip(want, got):
        assert got_tokens == want_tokens
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_matches_the_cpu_path(ckpt, llm, enforce_eager):
    """The GPU path (Triton attention, step buffers, CUDA graphs for the decode steps) gives the CPU
    path's tokens with images, chunks cut through them included."""
    prompts = [image_prompt("a", [picture(100, 170, 6), picture(60, 60, 7)]), "text only",
               image_prompt("b", [picture(70, 40, 13)]), image_prompt("c", [picture(300, 90, 14)])]
    want = [ours(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(ckpt, dtype="float32", device="cuda", max_model_len=256, block_size=8, max_num_seqs=4,
             max_num_batched_tokens=16, gpu_memory_utilization=0.2, enforce_eager=enforce_eager) as gpu:
        got = [ours(o) for o in gpu.generate(prompts, GREEDY, use_tqdm=False)]
    for (want_tokens, want_lps), (got_tokens, got_lps) in zip(want, got):
        assert got_tokens == want_tokens
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-3, rtol=0)


def test_prefix_cache_shares_blocks_only_for_the_same_image(tmp_path):
    """Full-attention layers only (the chunked-local group's hits: tests/models/test_kv_cache_groups.py):
    a prompt with the same image hits the
    blocks of its earlier run (up to inside the image: the rest of its features are merged from a
    fresh encoder pass) and answers the same; the same text with another image hits only the text
    blocks before the image, and still matches transformers."""
    hf = make_llama4_mm_model(seed=4, attention_chunk_size=8192, layer_types=["full_attention"] * 4)
    path = save_llama4_mm_checkpoint(hf, str(tmp_path / "ckpt"))
    llm = make_llm(path, enable_prefix_caching=True)
    cat, dog = picture(100, 100, 21), picture(100, 100, 22)
    first = llm.generate(image_prompt("the same words before it", [cat]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(image_prompt("the same words before it", [cat]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(image_prompt("the same words before it", [dog]), GREEDY, use_tqdm=False)[0]
    offset = llm.llm_engine.input.process_prompt(image_prompt("the same words before it", [cat])).mm_items[0].offset
    block = 8
    assert again.num_cached_tokens > offset + block  # into the image's span
    assert offset - block < other.num_cached_tokens <= offset  # the text blocks only
    assert ours(again)[0] == ours(first)[0]
    np.testing.assert_allclose(ours(again)[1], ours(first)[1], atol=1e-5, rtol=0)
    assert ours(other)[0] == reference(hf, llm, image_prompt("the same words before it", [dog]))[0]
    llm.shutdown()


@pytest.mark.parametrize("layout", [dict(data_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(data_parallel_size=2, enable_expert_parallel=True)])
def test_parallel_layouts_with_images_match_one_process(ckpt, llm, layout):
    """Data-parallel replicas (each with its own encoder budget), pipeline stages (the first one
    encodes and embeds), and DP + expert parallelism: the one-process tokens and logprobs."""
    import os
    os.environ.setdefault("MOE_COLLECTIVE_TIMEOUT_S", "60")
    prompts = [image_prompt("a", [picture(100, 170, 6), picture(60, 60, 7)]), "text only",
               image_prompt("b", [picture(70, 40, 13)]), image_prompt("c", [picture(56, 56, 2)])]
    want = [ours(o) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with make_llm(ckpt, max_num_batched_tokens=16, **layout) as par:
        got = [ours(o) for o in par.generate(prompts, GREEDY, use_tqdm=False)]
    for (want_tokens, want_lps), (got_tokens, got_lps) in zip(want, got):
        assert got_tokens == want_tokens
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-4, rtol=0)
