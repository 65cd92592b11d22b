"""The OpenAI request bodies `moe serve` accepts (pydantic), their SamplingParams, and the error body.

Unknown fields are ignored with a warning naming them (as by vLLM; `best_of` among them: vLLM's
server dropped it with V1, and `n` is what gives several samples); values are range-checked by
SamplingParams, so a bad one fails with the same message offline and served.

Types are strict, as OpenAI's API is: an integer field takes a JSON integer only (not "3", 3.5,
3.0 or true), a boolean field true/false only, a number field an integer or a float (not "0.5").
Integers beyond int64 and strings that are not valid Unicode (lone surrogates, which JSON's \\uXXXX
escapes can carry) are refused with the field's name, before they reach the engine.
"""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moe.sampling_params import INT64_MAX, SamplingParams

logger = logging.getLogger("moe.entrypoints.serve")

# The largest `n` (samples per prompt) one request may ask for: each sample is a sequence of its
# own in the engine, so an unbounded n lets one request take every slot. `moe serve` sets it at
# start from $MOE_MAX_N_SEQUENCES, else $VLLM_MAX_N_SEQUENCES (vLLM's name), else DEFAULT_MAX_N.
DEFAULT_MAX_N = 128
MAX_N = DEFAULT_MAX_N

# The most prompts one /v1/completions request may hold. Each is an engine request of its own (n
# sequences), and the body limit does not bound their number (a token-id prompt is 4 bytes: 8
# million fit in 32 MiB), so one unbounded request could queue hours of work ahead of everyone
# else. 1024 is ample for the batching clients do in one request; the server may set it.
MAX_PROMPTS = 1024

# An integer that msgpack (to the engine core) and torch int64 can hold.
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]


class ErrorResponse(Exception):
    """Raised by a handler: answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.err_type, self.param = message, status_code, err_type, param

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.status_code, self.param)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}, "object": "error"}


def _first_bad_text(value: Any, path: str) -> str | None:
    """Where in a JSON value (strings, keys, nested lists and dicts) a string is not valid Unicode,
    described without the bad text itself (the error body must stay encodable); None if nowhere.
    A loop, not recursion: a deeply nested body must not end in a RecursionError (a 500)."""
    todo = [(value, path)]
    while todo:
        v, where = todo.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                return f"{where} is not valid Unicode text: {e.reason} at position {e.start}"
        elif isinstance(v, dict):
            items = []
            for k, item in v.items():
                items.append((k, f"a key of {where}"))
                if isinstance(item, _TEXT_OR_NESTED):
                    items.append((item, f"{where}.{_escaped(k)}"))
            todo += reversed(items)
        elif isinstance(v, list):  # the paths of numbers (token ids) are not made: prompts can be long
            todo += reversed([(item, f"{where}[{i}]") for i, item in enumerate(v) if isinstance(item, _TEXT_OR_NESTED)])
    return None


_TEXT_OR_NESTED = (str, list, dict)


def _escaped(key: Any) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class _StrictModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any, info) -> Any:
        where = _first_bad_text(value, info.field_name)
        if where:
            raise ValueError(where)
        return value


class StreamOptions(_StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_StrictModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # `schema` would shadow BaseModel's
    strict: bool | None = None


class ResponseFormat(_StrictModel):
    """OpenAI's response_format: "text", "json_object", "json_schema" (with json_schema), and
    vLLM's "structural_tag" (structures and triggers)."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class _SamplingRequest(_StrictModel):
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[Int64] | None = None
    n: Int64 = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI's logit_bias has string keys (JSON object keys): token ids as text
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int64 | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extension: StructuredOutputsParams' fields (json, regex, choice, grammar, structural_tag, ...)
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _warn_ignored_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = sorted(_escaped(k) for k in data if k not in cls.model_fields)
            if ignored:
                logger.warning("fields of the request ignored: %s", ", ".join(ignored))
        return data

    @field_validator("n")
    @classmethod
    def _n_within_limit(cls, n: int) -> int:
        # MAX_N is read at each request, so that the server can change it after import.
        if n > MAX_N:
            raise ValueError(f"n={n} is more than this server allows: at most {MAX_N} samples per prompt")
        return n

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, structured_outputs=None) -> SamplingParams:
        """Unset values take OpenAI's defaults (temperature 1, top_p 1)."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, structured_outputs=structured_outputs)

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"invalid sampling parameter logit_bias: its keys are token ids, "
                                 f"got {_escaped(key)!r}")
            out[int(key)] = bias
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[Int64], list[list[Int64]], None] = None
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    # vLLM's extra parameter: each choice's "prompt_logprobs" (not with stream=True, as vLLM)
    prompt_logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, p: Any) -> Any:
        """One message for every malformed prompt (the union's own errors list each branch); a
        token id is a JSON integer: true (a Python int) and 1.0 are refused."""
        def is_id(x):
            return type(x) is int

        if p is None or isinstance(p, str):
            return p
        # Read at each request, as MAX_N; checked before the items, so a long list costs little. A
        # list of token ids is one prompt.
        if isinstance(p, list) and len(p) > MAX_PROMPTS and not is_id(p[0]):
            raise ValueError(f"prompt holds {len(p)} prompts, more than this server allows: at most {MAX_PROMPTS} "
                             "prompts per request")
        if isinstance(p, list) and (all(isinstance(x, str) for x in p) or all(is_id(x) for x in p)
                                    or all(isinstance(x, list) and all(is_id(t) for t in x) for x in p)):
            return p
        raise ValueError(f"prompt must be {_PROMPT_SHAPES} (token ids are integers, not booleans or floats)")

    def prompts(self) -> list[Any]:
        """The prompt as a list of engine prompts (a text or {"prompt_token_ids": [...]} each)."""
        p = self.prompt
        if p is None or p == [] or p == "":
            raise ErrorResponse("prompt is required: a string, a list of strings, token ids or lists of token ids",
                                param="prompt")
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": p}]
        empty = next((i for i, x in enumerate(p) if len(x) == 0), None)
        if empty is not None:
            raise ErrorResponse(f"prompt[{empty}] is empty: each prompt needs at least one token", param="prompt")
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]

    def requested_max_tokens(self) -> tuple[str, int] | None:
        """The max_tokens the client sent (its name and value), None for OpenAI's default of 16,
        which is capped to fit the context rather than refused."""
        if "max_tokens" in self.model_fields_set and self.max_tokens is not None:
            return "max_tokens", self.max_tokens
        return None


class FunctionDefinition(_StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolParam(_StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_StrictModel):
    name: str


class NamedToolChoice(_StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[ToolParam] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the reply
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> tuple[str, int] | None:
        """max_completion_tokens (OpenAI's current name) or else max_tokens, with its name; None
        when neither is set (the completion then takes what the context leaves)."""
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None

    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's turn opener. continue_final_message turns it
        off unless add_generation_prompt was sent true too: that pair is refused, as by vLLM."""
        if not self.continue_final_message:
            return self.add_generation_prompt
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise ErrorResponse("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                param="continue_final_message")
        return False

    def response_role(self) -> str:
        """The role of the generated message: the assistant after a generation prompt, else the
        last message's (its continuation), as vLLM answers."""
        if self.generation_prompt() or not self.messages:
            return "assistant"
        return str(self.messages[-1].get("role", "assistant"))

    def chat_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ErrorResponse("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


_IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def flatten_content(messages: list[dict]) -> list[dict]:
    """Message content given as a list of parts ([{"type": "text", "text": ...}]) joined into one
    string; a content with image parts stays a list (the chat template places the images)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and not any(isinstance(part, dict) and part.get("type") in _IMAGE_PART_TYPES
                                                 for part in content):
            texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out
