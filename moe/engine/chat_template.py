"""Chat templates: the `chat_template` of a checkpoint's tokenizer_config.json (or a file named
chat_template.jinja beside it), rendered with jinja2 the way transformers renders it: a sandboxed
environment with trim_blocks / lstrip_blocks, `raise_exception`, the `tojson` filter, and the
special tokens (bos_token, eos_token, ...) as variables."""
from __future__ import annotations

import json
import os
from functools import lru_cache

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self._template = _compile(source)

    @classmethod
    def load(cls, folder: str) -> "ChatTemplate | None":
        """The folder's chat template, or None when it has none."""
        config_file = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_file):
            with open(config_file) as f:
                config = json.load(f)
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

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        from jinja2.exceptions import TemplateError

        check_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special_tokens.items() if v is not None},
                                         **kwargs)
        except TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of parts")


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
