"""Chat templates: the `chat_template` of a checkpoint's tokenizer_config.json (or a file named
chat_template.jinja beside it), rendered with jinja2 the way transformers renders it: a sandboxed
environment with trim_blocks / lstrip_blocks, `raise_exception`, the `tojson` filter, and the
special tokens (bos_token, eos_token, ...) as variables.

A template can come with the request (`chat_template`), so rendering is bounded, and every way a
template can fail is a ValueError naming the problem (a 400 under `moe serve`): in any process the
bounded sandbox of moe.engine.template_sandbox checks a time and size budget as it goes, and under
`moe serve` templates render in the child processes of moe.engine.template_renderers as well,
killed at their deadline and capped in memory.

Limits (environment variables, read at each render; or `ChatTemplate(..., limits=TemplateLimits(...))`):
  MOE_CHAT_TEMPLATE_TIMEOUT_S          seconds to compile and render one conversation (default 5)
  MOE_CHAT_TEMPLATE_MAX_OUTPUT_CHARS   characters of output, and of any string or list built (default 4 MiB)
  MOE_CHAT_TEMPLATE_MAX_SOURCE_CHARS   characters of template source (default 128 KiB: compiling
                                       is ~20 us a character, Python's compile() holds the GIL)
"""
from __future__ import annotations

import json
import os

from moe.engine.template_renderers import render_in_renderer_process
from moe.engine.template_sandbox import MAX_OUTPUT_ENV, MAX_SOURCE_ENV, TIMEOUT_ENV, TemplateLimits, render_here

__all__ = ["MAX_OUTPUT_ENV", "MAX_SOURCE_ENV", "RESERVED_KWARGS", "SUPPORTED_PART_TYPES", "TIMEOUT_ENV", "ChatTemplate",
           "TemplateLimits", "check_content_parts", "check_messages", "check_template_kwargs", "check_tools",
           "read_chat_template", "template_limits"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")

# Content-part types a message may hold: text, and the image parts moe.engine.input_processor
# takes (OpenAI's image_url, vLLM's image_pil, transformers' image). Anything else (input_audio,
# video_url, file, ...) is refused: dropping it would build the prompt without it.
SUPPORTED_PART_TYPES = ("text", "image_url", "image_pil", "image")
# Variables the renderer sets itself (and the parameters of the functions that pass
# chat_template_kwargs on): a chat_template_kwargs key among them is refused, not a clash.
RESERVED_KWARGS = ("messages", "add_generation_prompt", "tools", *_SPECIAL, "chat_template", "self")


def template_limits(environ=os.environ) -> TemplateLimits:
    """The limits the environment sets (TemplateLimits' defaults for the variables not set)."""
    values = {}
    for field, name, kind in (("timeout_s", TIMEOUT_ENV, float), ("max_output_chars", MAX_OUTPUT_ENV, int),
                              ("max_source_chars", MAX_SOURCE_ENV, int)):
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            values[field] = kind(raw)
            if not values[field] > 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{name}={raw!r} must be a positive {'number' if kind is float else 'integer'}") from None
    return TemplateLimits(**values)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None],
                 limits: TemplateLimits | None = None) -> None:
        """limits: None reads the MOE_CHAT_TEMPLATE_* environment variables at each render. The
        source compiles at the first render, within that render's time budget."""
        if not isinstance(source, str):
            raise ValueError(f"a chat template must be a string, got {type(source).__name__}")
        self.source = source
        self.special_tokens = special_tokens
        self.limits = limits

    @staticmethod
    def _config(folder: str) -> dict:
        config_file = os.path.join(folder, "tokenizer_config.json")
        if not os.path.isfile(config_file):
            return {}
        with open(config_file) as f:
            return json.load(f)

    @classmethod
    def special_tokens_of(cls, folder: str) -> dict[str, str | None]:
        """bos_token, eos_token, ... of the folder's tokenizer_config.json (None where not set)."""
        config = cls._config(folder)
        return {k: _token_text(config.get(k)) for k in _SPECIAL}

    @classmethod
    def load(cls, folder: str) -> "ChatTemplate | None":
        """The folder's chat template, or None when it has none."""
        config = cls._config(folder)
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        jinja_file = os.path.join(folder, "chat_template.jinja")
        if source is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                source = f.read()
        if not isinstance(source, str):
            return None
        return cls(source, {k: _token_text(config.get(k)) for k in _SPECIAL})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               **kwargs) -> str:
        """tools: the functions the model may call (OpenAI's [{"type": "function", "function": {...}}]),
        given to the template as `tools` (None without), as transformers' apply_chat_template does."""
        check_messages(messages)
        check_tools(tools)
        check_template_kwargs(kwargs)
        limits = self.limits or template_limits()
        if len(self.source) > limits.max_source_chars:
            raise ValueError(f"the chat template is {len(self.source)} characters long, more than the limit of "
                             f"{limits.max_source_chars} ({MAX_SOURCE_ENV})")
        context = {**{k: v for k, v in self.special_tokens.items() if v is not None}, **kwargs,
                   "messages": template_messages(messages), "add_generation_prompt": add_generation_prompt,
                   "tools": tools}
        text = render_in_renderer_process(self.source, context, limits)
        if text is None:
            text = render_here(self.source, context, limits)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # the tokenizer would fail on it, less clearly
            raise ValueError(f"the chat template's output is not valid Unicode text: {e.reason} at position "
                             f"{e.start}") from None
        return text


# The names a message's reasoning comes under: vLLM's current `reasoning`, the older
# `reasoning_content` (DeepSeek's API, Qwen3's templates read it) and gpt-oss templates' `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to a template: keys whose value is null left out
    (OpenAI clients send `"content": null` beside tool_calls; templates test for a missing key,
    not for None), and a message's reasoning under each of REASONING_FIELDS."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        content = m.get("content")
        # null is OpenAI's for an assistant turn that only calls tools; a user or system turn
        # without content would render as "None".
        if content is None:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}]['content'] is missing or null: only an assistant message may "
                                 "leave it out")
        elif not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of content parts, got "
                             f"{type(content).__name__} {_shown(content)}")
        if m.get("tool_calls") is not None:
            _check_tool_calls(i, m["tool_calls"])
    check_content_parts(messages)


def _check_tool_calls(i: int, calls) -> None:
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}]['tool_calls'] must be a list of tool calls")
    for j, call in enumerate(calls):
        where = f"messages[{i}]['tool_calls'][{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': "
                             "...}}}}")
        if not isinstance(function.get("arguments", ""), (str, dict, type(None))):
            raise ValueError(f"{where}['function']['arguments'] must be a JSON object's text")


def check_tools(tools) -> None:
    """tools: None, or a non-empty list of {"type": "function", "function": {"name": ..., ...}}."""
    if tools is None:
        return
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools must be a non-empty list of {'type': 'function', 'function': {'name': ..., "
                         "'parameters': {...}}} (leave it out for none)")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "{...}}}}")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise ValueError(f"tools[{i}]['function']['parameters'] must be a JSON schema (an object)")


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: the path of a template file, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a template either (no {{{{ or {{%)")


def check_content_parts(messages) -> None:
    """Every content part is a {"type": ...} of SUPPORTED_PART_TYPES, a text part with a string text."""
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}]['content'][{j}]"
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError(f"{where} must be a content part: an object with a 'type' ('text' or 'image_url')")
            kind = part["type"]
            if not isinstance(kind, str) or kind not in SUPPORTED_PART_TYPES:
                raise ValueError(f"content part type {_shown(kind)} is not supported ({where}): the parts "
                                 "taken are 'text' and, for a model that takes images, 'image_url'")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"{where} is a 'text' part without a string 'text'")


def check_template_kwargs(kwargs) -> None:
    """chat_template_kwargs: a dict of extra template variables, none of RESERVED_KWARGS."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict of template variables, got {type(kwargs).__name__}")
    clash = [k for k in kwargs if k in RESERVED_KWARGS]
    if clash:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(map(_shown, clash))}: the chat renderer "
                         f"sets {'it' if len(clash) == 1 else 'them'} itself (reserved: {', '.join(RESERVED_KWARGS)})")

