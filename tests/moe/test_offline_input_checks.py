"""Offline inputs the input processor refuses by name, before anything is queued: chat content of
the wrong type, chat_template_kwargs that collide with the renderer's own arguments, and image
placeholders that no attached image backs."""
from __future__ import annotations

import pytest

from moe import LLM, SamplingParams
from moe.config import EngineArgs
from moe.engine.input_processor import InputProcessor
from moe.engine.model_info import resolve_model_info
from tests.factories_llama4_mm import (TOKEN_IDS, make_llama4_mm_model, picture, save_llama4_mm_checkpoint)

ENGINE = {"device": "cpu", "max_model_len": 64, "kv_cache_memory_bytes": 8 << 20}
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
ONE_TOKEN = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def llm():
    from models.tiny import ensure_tiny_model

    llm = LLM(ensure_tiny_model("tiny-qwen3-moe"), **ENGINE)
    yield llm
    llm.shutdown()


def chat(llm, messages, **kwargs):
    return llm.chat(messages, ONE_TOKEN, use_tqdm=False, chat_template=TEMPLATE, **kwargs)


# ---- chat content ---------------------------------------------------------------------------------

@pytest.mark.parametrize("content,shown", [(5, "int 5"), ({"text": "hi"}, "dict {'text': 'hi'}"),
                                           (True, "bool True"), (1.5, "float 1.5")])
def test_content_of_the_wrong_type_is_named_with_its_index(llm, content, shown):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    with pytest.raises(ValueError, match=rf"^messages\[1\]\['content'\] must be a string or a list of content "
                                         rf"parts, got {shown}"):
        chat(llm, messages)
    assert not llm.llm_engine.has_unfinished_requests()


def test_null_content_only_for_an_assistant_message(llm):
    with pytest.raises(ValueError, match=r"^messages\[0\]\['content'\] is missing or null"):
        chat(llm, [{"role": "user", "content": None}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\['content'\] is missing or null"):
        chat(llm, [{"role": "user"}])
    p = llm.llm_engine.input.process_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                                           {"role": "user", "content": [{"type": "text", "text": "again"}]}],
                                          True, TEMPLATE)
    assert p.prompt.startswith("user: hi\nassistant: ") and p.prompt_token_ids


# ---- chat_template_kwargs -------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,named", [
    ({"messages": []}, "'messages'"),
    ({"add_generation_prompt": False, "mood": "calm"}, "'add_generation_prompt'"),
    ({"chat_template": "x"}, "'chat_template'"),
    ({"self": 1, "messages": []}, "'self', 'messages'"),
])
def test_colliding_template_kwargs_are_value_errors(llm, kwargs, named):
    """These were TypeErrors of process_chat's call ("got multiple values for argument")."""
    with pytest.raises(ValueError, match=f"^chat_template_kwargs cannot set {named}: the chat renderer sets"):
        chat(llm, [{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    with pytest.raises(ValueError, match=f"^chat_template_kwargs cannot set {named}"):
        llm.llm_engine.input.render_chat([{"role": "user", "content": "hi"}], True, TEMPLATE, **kwargs)


def test_other_template_kwargs_still_reach_the_template(llm):
    p = llm.llm_engine.input.process_chat([{"role": "user", "content": "hi"}], True, "{{ mood }}!", mood="calm")
    assert p.prompt == "calm!"


# ---- image placeholders ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mm_input(tmp_path_factory):
    """The input processor of a tiny Llama-4 that takes images (no engine: only the inputs side)."""
    folder = save_llama4_mm_checkpoint(make_llama4_mm_model(seed=1), str(tmp_path_factory.mktemp("mm_inputs")))
    return InputProcessor(resolve_model_info(EngineArgs(model=folder, device="cpu", max_model_len=256)))


IMAGE = TOKEN_IDS["<|image|>"]


@pytest.mark.parametrize("prompt", ["what is in <|image|>?", {"prompt": "<|image|> here"},
                                    {"prompt_token_ids": [1, 2, IMAGE, 3]},
                                    {"prompt": "<|image|>", "multi_modal_data": {"image": []}}])
def test_a_placeholder_without_an_image_is_refused(mm_input, prompt):
    with pytest.raises(ValueError, match=r"image placeholder <\|image\|> \(token id \d+\) but no image is attached"):
        mm_input.process_prompt(prompt)


def test_expansion_tokens_in_a_text_prompt_are_refused(mm_input):
    with pytest.raises(ValueError, match=r"the prompt holds <\|patch\|> .* a token of an image's expansion"):
        mm_input.process_prompt("caption <|patch|>")


def test_more_placeholders_than_images_is_refused(mm_input):
    prompt = {"prompt": "<|image|> and <|image|>", "multi_modal_data": {"image": picture(30, 30, 1)}}
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) .* but 1 image\(s\) were given"):
        mm_input.process_prompt(prompt)


def test_chat_text_with_a_placeholder_and_no_image_part_is_refused(mm_input):
    with pytest.raises(ValueError, match="but no image is attached"):
        mm_input.process_chat([{"role": "user", "content": "describe <|image|>"}])


def test_prompts_with_matching_images_or_none_pass(mm_input):
    assert mm_input.process_prompt("a plain prompt").mm_items == []
    p = mm_input.process_prompt({"prompt": "<|image|> what?", "multi_modal_data": {"image": picture(30, 30, 2)}})
    assert len(p.mm_items) == 1
