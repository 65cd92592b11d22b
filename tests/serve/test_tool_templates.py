"""Tool-use chat templates in the sandbox: tools in the context, assistant turns with tool_calls
and tool turns render as transformers renders them (Qwen3-, DeepSeek-V3- and Llama-4-style
templates, tests/serve/templates/), in-process and in a renderer process; each template gets the
arguments in the form it reads (text or dict) from OpenAI's JSON-text arguments."""
from __future__ import annotations

import copy
import json
import os

import pytest

from moe.engine import template_renderers
from moe.engine.chat_template import ChatTemplate, check_template_kwargs, read_chat_template
from tests.serve.helpers import make_chat_model

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ARGS = {"city": "Tōkyō", "days": 2}
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(ARGS, ensure_ascii=False)}}]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temp_c": 21}'},
]


def source(name: str) -> str:
    with open(os.path.join(TEMPLATES, name)) as f:
        return f.read()


def with_dict_arguments(messages):
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(make_chat_model(str(tmp_path_factory.mktemp("hf"))))


# transformers is given the arguments in the form each template reads: a dict (its convention),
# or for DeepSeek-V3's, which concatenates them, the text
@pytest.mark.parametrize("name,hf_dicts", [("qwen3.jinja", True), ("deepseek_v3.jinja", False),
                                           ("llama4_pythonic.jinja", True)])
@pytest.mark.parametrize("in_renderer_process", [False, True])
def test_tool_conversation_renders_as_transformers_does(hf_tokenizer, name, hf_dicts, in_renderer_process):
    template = ChatTemplate(source(name), {"bos_token": "<s>"})
    hf_messages = with_dict_arguments(CONVERSATION) if hf_dicts else CONVERSATION
    theirs = hf_tokenizer.apply_chat_template(hf_messages, tools=TOOLS, chat_template=template.source, tokenize=False,
                                              add_generation_prompt=True, bos_token="<s>")
    if in_renderer_process:
        template_renderers.use_renderer_processes(1)
    try:
        ours = template.render(copy.deepcopy(CONVERSATION), add_generation_prompt=True, tools=TOOLS)
    finally:
        if in_renderer_process:
            template_renderers.stop_renderer_processes()
    assert ours == theirs
    assert "get_weather" in ours and "Tōkyō" in ours and "21" in ours


def test_qwen3_template_without_tools_and_with_thinking_off(hf_tokenizer):
    template = ChatTemplate(source("qwen3.jinja"), {})
    messages = [{"role": "user", "content": "Hi"}]
    ours = template.render(messages, add_generation_prompt=True, enable_thinking=False)
    assert ours == hf_tokenizer.apply_chat_template(messages, chat_template=template.source, tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=False)
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and "# Tools" not in ours


def test_arguments_the_caller_passed_are_not_changed():
    messages = copy.deepcopy(CONVERSATION)
    ChatTemplate(source("llama4_pythonic.jinja"), {}).render(messages, tools=TOOLS)
    assert messages == CONVERSATION


def test_tools_is_not_a_template_kwarg_and_bad_tools_are_refused():
    with pytest.raises(ValueError, match="cannot set 'tools'"):
        check_template_kwargs({"tools": TOOLS})
    template = ChatTemplate("{{ tools }}", {})
    for bad, match in [([], "non-empty list"), ([{"type": "function"}], r"tools\[0\]"),
                       ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "JSON schema")]:
        with pytest.raises(ValueError, match=match):
            template.render([{"role": "user", "content": "x"}], tools=bad)
    with pytest.raises(ValueError, match=r"messages\[0\]\['tool_calls'\]\[0\]"):
        template.render([{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}])


def test_transformers_extras_strftime_now_and_generation_tag():
    template = ChatTemplate("{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}", {})
    assert template.render([{"role": "user", "content": "x"}]).isdigit()


def test_read_chat_template_takes_a_file_or_the_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{% endfor %}") == "{% for m in messages %}{% endfor %}"
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_llm_chat_passes_tools_to_the_template(llm):
    from moe import SamplingParams

    template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0]['content'] }}"
    (out,) = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=1), use_tqdm=False,
                      chat_template=template, tools=TOOLS)
    assert out.prompt == "get_weather;Hi"


def test_a_chat_without_any_template_names_the_ways_to_give_one(tmp_path):
    from types import SimpleNamespace

    from moe.engine.input_processor import InputProcessor

    info = SimpleNamespace(tokenizer=None, model_config=SimpleNamespace(vocab_size=10), max_model_len=16,
                           max_logprobs=1, model_path=str(tmp_path))
    with pytest.raises(ValueError, match="has no chat template .*`moe serve --chat-template FILE`"):
        InputProcessor(info).render_chat([{"role": "user", "content": "Hi"}])
