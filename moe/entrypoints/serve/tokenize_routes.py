"""/tokenize and /detokenize, with vLLM's bodies and answers.

POST /tokenize {"model", "prompt"} or {"model", "messages"} (rendered with the chat template, as
/v1/chat/completions renders them, with the request's `tools`) -> {"count", "max_model_len", "tokens", "token_strs"}.
add_special_tokens defaults to true for a prompt and false for messages (the template writes the
special tokens itself); token_strs is the vocabulary's spelling of each token with
return_token_strs, else null.
POST /detokenize {"model", "tokens"} -> {"prompt": text}, special tokens kept.

Both run in the engine's input thread pool (a long prompt or a slow template must not hold up the
event loop) and answer a bad body with a 400 in the server's OpenAI-style error body.
"""
from __future__ import annotations

from typing import Any, Callable

from moe.engine.chat_template import check_content_parts, check_template_kwargs
from moe.entrypoints.serve.protocol import ErrorResponse, Int64, ToolParam, _StrictModel, flatten_content


class TokenizeRequest(_StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None  # for the template, as in a chat request
    return_token_strs: bool = False


class DetokenizeRequest(_StrictModel):
    model: str | None = None
    tokens: list[Int64]


def add_tokenize_routes(app, engine, check_model: Callable[[str | None], None]) -> None:
    """Register /tokenize and /detokenize on `app`; check_model refuses a model name not served."""

    def tokenizer():
        if engine.input.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json: nothing to tokenize with")
        return engine.input.tokenizer

    def tokenize(body: TokenizeRequest) -> dict:
        tok = tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise ErrorResponse("give either prompt (a string) or messages (a chat), not both or neither",
                                param="prompt")
        if body.messages is not None:
            check_content_parts(body.messages)
            messages = flatten_content(body.messages)
            if any(isinstance(m.get("content"), list) for m in messages):  # images are expanded per request
                raise ErrorResponse("/tokenize takes text messages only (no image parts)", param="messages")
            kwargs = body.chat_template_kwargs or {}
            check_template_kwargs(kwargs)
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = engine.input.render_chat(messages, body.add_generation_prompt, body.chat_template, tools, **kwargs)
            add_special = bool(body.add_special_tokens)
        else:
            text = body.prompt
            add_special = body.add_special_tokens is not False
        ids = tok.encode(text, add_special_tokens=add_special)
        strs = [tok.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(body: DetokenizeRequest) -> dict:
        tok = tokenizer()
        vocab = engine.input.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ErrorResponse(f"token id {bad} is out of vocabulary (vocab_size={vocab})", param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    async def run(fn, body):
        check_model(body.model)
        try:
            return await engine.run_input(fn, body)
        except ValueError as e:  # a template or message problem: the client's, as in chat
            raise ErrorResponse(str(e), 400, "BadRequestError") from None

    @app.post("/tokenize")
    async def create_tokenize(body: TokenizeRequest):
        return await run(tokenize, body)

    @app.post("/detokenize")
    async def create_detokenize(body: DetokenizeRequest):
        return await run(detokenize, body)
