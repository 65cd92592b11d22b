"""The OpenAI completion and chat-completion handlers: request -> engine prompts and SamplingParams,
engine deltas -> one JSON response or a stream of server-sent events ending in `data: [DONE]`.
This file holds their common part and the completions handler; chat_handler.py the chat one.

A request's input processing (chat template, tokenisation, image decoding: seconds for a long
prompt, a large image or a hostile template) runs in the engine's input thread pool, so that the
event loop keeps serving the other clients (and /health) meanwhile.

Choice index of prompt i's sequence j is i * n + j (as vLLM numbers them). Usage counts each
prompt's tokens once and every generated token.

Completions' logprobs name each token by its text, as OpenAI's legacy format does. Where that text
would not tell tokens apart, the name does (a `top_logprobs` dict would otherwise keep one of
them): a token whose bytes are not whole UTF-8 characters on their own (part of a character,
decoded "\ufffd") is named by its bytes, "bytes:\\xe2\\x80" (OpenAI's legacy form); a token whose
name another token of the same position already has gets "token_id:<id>" (vLLM's token-id form),
the chosen token keeping the plain name. `tokens` uses the same names; `text_offset` counts the
decoded text. Chat logprobs are lists ({"token", "logprob", "bytes"}): nothing collapses there, and
`bytes` holds the token's own bytes.
"""
from __future__ import annotations

import asyncio
import base64
import io
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import numpy as np

from moe.engine.core_client import EngineDeadError
from moe.engine.input_processor import ProcessedPrompt
from moe.entrypoints.serve.constraints import request_constraint
from moe.entrypoints.serve.protocol import CompletionRequest, ErrorResponse
from moe.outputs import CompletionOutput, RequestOutput
from moe.sampling_params import SamplingParams


def _bad_request(exc: ValueError) -> ErrorResponse:
    return ErrorResponse(str(exc), 400, "BadRequestError")


def _finite(logprob: float) -> float:
    """-inf (a token the model cannot produce) as -9999.0, OpenAI's value: JSON has no infinity."""
    return max(logprob, -9999.0)


class _TokenNames:
    """Names of tokens in completions' logprobs (the module docstring says which), one request's worth cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._name: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode_token(token_id) if self.tokenizer else str(token_id)
        return text

    def bytes(self, token_id: int) -> bytes:
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else None
        return raw if raw is not None else self.text(token_id).encode("utf-8")

    def name(self, token_id: int) -> str:
        name = self._name.get(token_id)
        if name is None:
            name = self.text(token_id)
            if "\ufffd" in name:
                raw = self.bytes(token_id)
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._name[token_id] = name
        return name

    def distinct(self, token_ids: list[int]) -> dict[int, str]:
        """Each id's name, the later of two equal names replaced by "token_id:<id>"."""
        out: dict[int, str] = {}
        used: set[str] = set()
        for t in token_ids:
            if t in out:
                continue
            name = self.name(t)
            if name in used:
                name = f"token_id:{t}"
            out[t] = name
            used.add(name)
        return out


def prompt_logprobs_json(entries: list | None) -> list | None:
    """RequestOutput.prompt_logprobs as vLLM's server returns it: None for the first token, else
    {token id: {"logprob", "rank", "decoded_token"}} (JSON keys are strings)."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: object = None


def routed_experts_json(routed) -> str:
    """A finished choice's routed experts (enable_return_routed_experts) as the server returns them:
    base64 of the int16 array in .npy form, which carries its shape
    (np.load(io.BytesIO(base64.b64decode(s))) reads it back)."""
    buf = io.BytesIO()
    np.save(buf, routed, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


async def _merge(gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta) from several request iterators as they come; closing the merged
    iterator (a client gone) cancels the others, which aborts their requests."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait(exc)
        queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Handler:
    object_name = ""    # "object" of a response
    chunk_object = ""   # "object" of a streamed chunk
    id_prefix = ""
    prompt_what = "the prompt"  # how an error names the request's input

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _prepare(self, body) -> tuple[list[ProcessedPrompt], SamplingParams, object]:
        """The engine prompts, their SamplingParams, and the request's state for its outputs (None
        for none)."""
        raise NotImplementedError

    def _checked(self, body, prompts: list[ProcessedPrompt], params: SamplingParams, state) -> SamplingParams:
        """The params once their checks passed (a handler may change them then, and check again)."""
        return params

    def _prepare_checked(self, body) -> tuple[list[ProcessedPrompt], SamplingParams, object]:
        """_prepare and the checks of its result; in a thread of the engine's input pool."""
        prompts, params, state = self._prepare(body)
        self.engine.input.check_params(params)
        asked = body.requested_max_tokens()
        if asked is not None:
            name, max_tokens = asked
            for p in prompts:
                self.engine.input.check_context_length(len(p.prompt_token_ids), max_tokens, self.prompt_what, name)
        return prompts, self._checked(body, prompts, params, state), state

    async def create(self, body):
        """A dict (the response) or, with stream, an async iterator of SSE lines."""
        from moe.entrypoints.serve.api_server import first_then_rest

        try:
            prompts, params, state = await self.engine.run_input(self._prepare_checked, body)
        except ValueError as e:
            raise _bad_request(e) from None
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        gens = [self.engine.generate(p, params, f"{request_id}-{i}") for i, p in enumerate(prompts)]
        created = int(time.time())
        if body.stream:
            # The first delta is awaited here: a dead engine still gets a status code, not a broken stream.
            return await first_then_rest(self._stream(body, request_id, created, prompts, params.n, _merge(gens),
                                                      state))
        choices: dict[int, _Choice] = {}
        prompt_logprobs: dict[int, list] = {}  # by prompt index (its n choices share them)
        async for i, out in _merge(gens):
            if out.error is not None:
                raise ErrorResponse(f"the engine failed this request: {out.error}", 500, "InternalServerError")
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for o in out.outputs:
                c = choices.setdefault(i * params.n + o.index, _Choice())
                c.text += o.text
                c.token_ids += o.token_ids
                c.logprobs += o.logprobs or []
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
                if o.routed_experts is not None:
                    c.routed_experts = o.routed_experts
        out_choices = []
        for k in sorted(choices):
            choice = self._choice(body, k, choices[k], prompts[k // params.n], prompt_logprobs.get(k // params.n),
                                  state)
            if choices[k].routed_experts is not None:
                choice["routed_experts"] = routed_experts_json(choices[k].routed_experts)
            out_choices.append(choice)
        return {"id": request_id, "object": self.object_name, "created": created, "model": self.model_name,
                "choices": out_choices, "usage": _usage(prompts, sum(len(c.token_ids) for c in choices.values()))}

    async def _stream(self, body, request_id, created, prompts, n, merged, state=None):
        from moe.entrypoints.serve.api_server import sse

        num_generated = 0
        started: set[int] = set()
        prompt_logprobs: dict[int, list] = {}  # by prompt index: they come with its first delta
        sent_any = False
        try:
            async for i, out in merged:
                if out.error is not None:
                    yield sse({"error": {"message": f"the engine failed this request: {out.error}",
                                         "type": "InternalServerError", "code": 500}})
                    return
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                for o in out.outputs:
                    k = i * n + o.index
                    num_generated += len(o.token_ids)
                    chunks = self._chunks(body, k, o, prompts[i], k not in started, prompt_logprobs.get(i), state)
                    if o.routed_experts is not None and chunks:  # on the choice's last chunk, with its finish
                        chunks[-1]["routed_experts"] = routed_experts_json(o.routed_experts)
                    for chunk in chunks:
                        started.add(k)
                        sent_any = True
                        yield sse({"id": request_id, "object": self.chunk_object, "created": created,
                                   "model": self.model_name, "choices": [chunk]})
        except EngineDeadError as e:
            if not sent_any:
                raise  # still before the response: a 503
            yield sse({"error": {"message": str(e), "type": "EngineDeadError", "code": 503}})
            return
        if body.include_usage:
            yield sse({"id": request_id, "object": self.chunk_object, "created": created, "model": self.model_name,
                       "choices": [], "usage": _usage(prompts, num_generated)})
        yield sse("[DONE]")


def _usage(prompts: list[ProcessedPrompt], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p.prompt_token_ids) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class CompletionHandler(_Handler):
    object_name, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def _prepare(self, body: CompletionRequest):
        if body.suffix is not None:
            raise ValueError("suffix is not supported")
        if body.stream and body.prompt_logprobs:  # vLLM's rule (0 is let through)
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        prompts = body.prompts()
        # vLLM: echo with logprobs scores the echoed prompt too, with logprobs alternatives unless
        # prompt_logprobs says otherwise.
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:
            prompt_logprobs = body.logprobs
        params = body.sampling_params(body.max_tokens, body.logprobs, prompt_logprobs,
                                      request_constraint(body.structured_outputs, body.response_format))
        processed = []
        for i, p in enumerate(prompts):
            try:
                processed.append(self.engine.input.process_prompt(p, params.truncate_prompt_tokens))
            except ValueError as e:
                if len(prompts) == 1:
                    raise
                raise ValueError(f"prompt[{i}]: {e}") from None  # which of the batch
        return processed, params, None

    def _echo(self, body, prompt: ProcessedPrompt) -> str:
        if not body.echo:
            return ""
        if prompt.prompt is not None:
            return prompt.prompt
        tok = self.engine.info.tokenizer
        return tok.decode(prompt.prompt_token_ids, skip_special_tokens=False) if tok is not None else ""

    def _logprobs(self, body, token_ids: list[int], entries: list, text_start: int) -> dict | None:
        """OpenAI's legacy logprobs of the tokens; an entry None (the first prompt token, echoed)
        has no logprob and no alternatives."""
        if body.logprobs is None:
            return None
        names = _TokenNames(self.engine.info.tokenizer)
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = text_start
        for tid, entry in zip(token_ids, entries):
            offsets.append(offset)
            offset += len(names.text(tid))
            if entry is None:
                tokens.append(names.name(tid))
                token_logprobs.append(None)
                tops.append(None)
                continue
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:max(body.logprobs, 1)]
            named = names.distinct([tid, *(t for t, _ in ranked)])  # the chosen token keeps its name
            tokens.append(named[tid])
            token_logprobs.append(_finite(entry[tid].logprob))
            tops.append({named[t]: _finite(lp.logprob) for t, lp in ranked} if body.logprobs else None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _scored(self, body, prompt: ProcessedPrompt, prompt_logprobs: list | None, echo: str,
                token_ids: list[int], entries: list) -> tuple[list[int], list, int]:
        """The tokens and logprob entries a choice reports, and the text offset of the first: with
        echo and logprobs the prompt's come first (vLLM's shape), from text offset 0."""
        if not echo or body.logprobs is None:
            return token_ids, entries, len(echo)
        ids = prompt.prompt_token_ids
        return ids + token_ids, (prompt_logprobs or [None] * len(ids)) + entries, 0

    def _choice(self, body, index: int, c: _Choice, prompt: ProcessedPrompt,
                prompt_logprobs: list | None = None, state=None) -> dict:
        echo = self._echo(body, prompt)
        token_ids, entries, start = self._scored(body, prompt, prompt_logprobs, echo, c.token_ids, c.logprobs)
        return {"index": index, "text": echo + c.text, "logprobs": self._logprobs(body, token_ids, entries, start),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(prompt_logprobs)}

    def _chunks(self, body, index: int, o: CompletionOutput, prompt: ProcessedPrompt, first: bool,
                prompt_logprobs: list | None = None, state=None) -> list[dict]:
        echo = self._echo(body, prompt) if first else ""
        token_ids, entries, start = self._scored(body, prompt, prompt_logprobs, echo, o.token_ids, o.logprobs or [])
        return [{"index": index, "text": echo + o.text, "logprobs": self._logprobs(body, token_ids, entries, start),
                 "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}]
