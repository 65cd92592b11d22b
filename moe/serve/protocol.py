"""The OpenAI request bodies `moe serve` accepts (pydantic), their SamplingParams, and the error body.

Unknown fields are ignored (as by vLLM); values are range-checked by SamplingParams, so a bad one
fails with the same message offline and served.
"""
from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from moe.sampling_params import SamplingParams


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


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Unset values take OpenAI's defaults (temperature 1, top_p 1)."""
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p, seed=self.seed, max_tokens=max_tokens,
            min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

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
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def chat_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ErrorResponse("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


def flatten_content(messages: list[dict]) -> list[dict]:
    """Message content given as a list of parts ([{"type": "text", "text": ...}]) joined into one string."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            texts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
            m = {**m, "content": "\n".join(texts)}
        out.append(m)
    return out
