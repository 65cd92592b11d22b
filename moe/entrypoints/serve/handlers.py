"""The OpenAI completion and chat-completion handlers: request -> engine prompts and SamplingParams,
engine deltas -> one JSON response or a stream of server-sent events ending in `data: [DONE]`.

A request's input processing (chat template, tokenisation, image decoding: seconds for a long
prompt, a large image or a hostile template) runs in the engine's input thread pool, so that the
event loop keeps serving the other clients (and /health) meanwhile.

Choice index of prompt i's sequence j is i * n + j (as vLLM numbers them). Usage counts each
prompt's tokens once and every generated token.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from moe.engine.chat_template import check_messages
from moe.engine.core_client import EngineDeadError
from moe.engine.input_processor import ProcessedPrompt, split_chat_images
from moe.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, flatten_content
from moe.outputs import CompletionOutput, RequestOutput


def _bad_request(exc: ValueError) -> ErrorResponse:
    return ErrorResponse(str(exc), 400, "BadRequestError")


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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

    def _prepare(self, body) -> tuple[list[ProcessedPrompt], object]:
        raise NotImplementedError

    def _prepare_checked(self, body) -> tuple[list[ProcessedPrompt], object]:
        """_prepare and the checks of its result; in a thread of the engine's input pool."""
        prompts, params = self._prepare(body)
        self.engine.input.check_params(params)
        asked = body.requested_max_tokens()
        if asked is not None:
            name, max_tokens = asked
            for p in prompts:
                self.engine.input.check_context_length(len(p.prompt_token_ids), max_tokens, self.prompt_what, name)
        return prompts, params

    async def create(self, body):
        """A dict (the response) or, with stream, an async iterator of SSE lines."""
        from moe.entrypoints.serve.api_server import first_then_rest

        try:
            prompts, params = await self.engine.run_input(self._prepare_checked, body)
        except ValueError as e:
            raise _bad_request(e) from None
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        gens = [self.engine.generate(p, params, f"{request_id}-{i}") for i, p in enumerate(prompts)]
        created = int(time.time())
        if body.stream:
            # The first delta is awaited here: a dead engine still gets a status code, not a broken stream.
            return await first_then_rest(self._stream(body, request_id, created, prompts, params.n, _merge(gens)))
        choices: dict[int, _Choice] = {}
        async for i, out in _merge(gens):
            if out.error is not None:
                raise ErrorResponse(f"the engine failed this request: {out.error}", 500, "InternalServerError")
            for o in out.outputs:
                c = choices.setdefault(i * params.n + o.index, _Choice())
                c.text += o.text
                c.token_ids += o.token_ids
                c.logprobs += o.logprobs or []
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        return {"id": request_id, "object": self.object_name, "created": created, "model": self.model_name,
                "choices": [self._choice(body, k, choices[k], prompts[k // params.n]) for k in sorted(choices)],
                "usage": _usage(prompts, sum(len(c.token_ids) for c in choices.values()))}

    async def _stream(self, body, request_id, created, prompts, n, merged):
        from moe.entrypoints.serve.api_server import sse

        num_generated = 0
        started: set[int] = set()
        sent_any = False
        try:
            async for i, out in merged:
                if out.error is not None:
                    yield sse({"error": {"message": f"the engine failed this request: {out.error}",
                                         "type": "InternalServerError", "code": 500}})
                    return
                for o in out.outputs:
                    k = i * n + o.index
                    num_generated += len(o.token_ids)
                    chunk = self._chunk(body, k, o, prompts[i], first=k not in started)
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
        prompts = body.prompts()
        params = body.sampling_params(body.max_tokens, body.logprobs)
        processed = []
        for i, p in enumerate(prompts):
            try:
                processed.append(self.engine.input.process_prompt(p, params.truncate_prompt_tokens))
            except ValueError as e:
                if len(prompts) == 1:
                    raise
                raise ValueError(f"prompt[{i}]: {e}") from None  # which of the batch
        return processed, params

    def _echo(self, body, prompt: ProcessedPrompt) -> str:
        if not body.echo:
            return ""
        if prompt.prompt is not None:
            return prompt.prompt
        tok = self.engine.info.tokenizer
        return tok.decode(prompt.prompt_token_ids, skip_special_tokens=False) if tok is not None else ""

    def _logprobs(self, body, token_ids: list[int], entries: list, text_start: int) -> dict | None:
        if body.logprobs is None:
            return None
        decode = self.engine.info.tokenizer.decode_token if self.engine.info.tokenizer else str
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = text_start
        for tid, entry in zip(token_ids, entries):
            piece = decode(tid)
            tokens.append(piece)
            token_logprobs.append(entry[tid].logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:max(body.logprobs, 1)]
            tops.append({decode(t): lp.logprob for t, lp in ranked} if body.logprobs else None)
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, body, index: int, c: _Choice, prompt: ProcessedPrompt) -> dict:
        echo = self._echo(body, prompt)
        return {"index": index, "text": echo + c.text, "logprobs": self._logprobs(body, c.token_ids, c.logprobs,
                                                                                 len(echo)),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _chunk(self, body, index: int, o: CompletionOutput, prompt: ProcessedPrompt, first: bool) -> dict:
        echo = self._echo(body, prompt) if first else ""
        return {"index": index, "text": echo + o.text,
                "logprobs": self._logprobs(body, o.token_ids, o.logprobs or [], len(echo)),
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}


class ChatHandler(_Handler):
    object_name, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    prompt_what = "the messages"

    def _prepare(self, body: ChatCompletionRequest):
        if not body.messages:
            raise ValueError("messages is required: a non-empty list of {'role': ..., 'content': ...}")
        check_messages(body.messages)  # before flatten_content, which keeps only the text parts
        messages = flatten_content(body.messages)
        kwargs = body.chat_template_kwargs or {}
        if body.continue_final_message:
            prompt = self._continue_final(messages, body.generation_prompt(), body.chat_template, kwargs)
        else:
            prompt = self.engine.input.process_chat(messages, body.generation_prompt(), body.chat_template, **kwargs)
        asked = body.requested_max_tokens()
        params = body.sampling_params(None if asked is None else asked[1], body.chat_logprobs())
        # cut after rendering, as LLM.chat's: the rendered prompt must fit max_model_len
        return [self.engine.input.truncate(prompt, params.truncate_prompt_tokens)], params

    def _continue_final(self, messages: list[dict], add_generation_prompt: bool, template: str | None,
                        kwargs: dict) -> ProcessedPrompt:
        """The conversation rendered so that it ends inside the last message (the model continues
        it): a marker appended to that message's content shows where its text ends."""
        if add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt false")
        messages, images = split_chat_images(messages)
        content = messages[-1].get("content")
        if not isinstance(content, str):
            raise ValueError("continue_final_message: the last message needs a text content to continue")
        marker = f"<moe-continue-{uuid.uuid4().hex}>"
        marked = [*messages[:-1], {**messages[-1], "content": content + marker}]
        text = self.engine.input.render_chat(marked, False, template, **kwargs)
        if text.count(marker) != 1:
            raise ValueError("continue_final_message: the chat template does not render the last message's "
                             "content as given, so there is no end of it to continue from")
        text = text[:text.index(marker)]
        tok = self.engine.input.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer: this model folder has no tokenizer.json")
        # The template writes the special tokens itself, as for any chat prompt.
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        return self.engine.input.process_prompt(prompt)

    @staticmethod
    def _echo(body: ChatCompletionRequest) -> str:
        """With echo: the last message's content when the reply continues that role (vLLM's rule)."""
        if not body.echo or not body.messages:
            return ""
        last = flatten_content(body.messages[-1:])[0]
        if last.get("role") != body.response_role():
            return ""
        return last.get("content") or ""

    def _logprobs(self, body, token_ids: list[int], entries: list) -> dict | None:
        if not body.logprobs:
            return None
        decode = self.engine.info.tokenizer.decode_token

        def item(tid, lp):
            text = decode(tid)
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for tid, entry in zip(token_ids, entries):
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:body.top_logprobs or 0]
            content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, lp) for t, lp in ranked]})
        return {"content": content}

    def _choice(self, body, index: int, c: _Choice, prompt: ProcessedPrompt) -> dict:
        return {"index": index, "message": {"role": body.response_role(), "content": self._echo(body) + c.text},
                "logprobs": self._logprobs(body, c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def _chunk(self, body, index: int, o: CompletionOutput, prompt: ProcessedPrompt, first: bool) -> dict:
        if first:
            delta = {"role": body.response_role(), "content": self._echo(body) + o.text}
        else:
            delta = {"content": o.text}
        return {"index": index, "delta": delta, "logprobs": self._logprobs(body, o.token_ids, o.logprobs or []),
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
