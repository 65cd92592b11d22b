"""`moe serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an engine core process.

Endpoints: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events),
/v1/models, /health (503 once the engine core is gone), /version, /metrics (Prometheus text).
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from contextlib import asynccontextmanager

from moe.config import EngineArgs
from moe.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, error_body

logger = logging.getLogger("moe.serve")


def build_app(args: EngineArgs, served_model_name: str | None = None, api_key: str | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    import moe
    from moe.core_client import EngineDeadError
    from moe.serve.async_llm import AsyncLLM
    from moe.serve.handlers import ChatHandler, CompletionHandler

    engine = AsyncLLM(args)
    model_name = served_model_name or args.model

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        app.state.engine = engine
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="moe-runtime", version=moe.__version__, lifespan=lifespan)
    completions = CompletionHandler(engine, model_name)
    chat = ChatHandler(engine, model_name)

    def error_response(e: ErrorResponse) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status_code)

    @app.exception_handler(ErrorResponse)
    async def _on_error(request: Request, exc: ErrorResponse):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:])
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "BadRequestError", 400, where or None), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _on_dead(request: Request, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), "EngineDeadError", 503), status_code=503)

    @app.middleware("http")
    async def _check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return JSONResponse(error_body("invalid or missing API key", "AuthenticationError", 401),
                                    status_code=401)
        return await call_next(request)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ErrorResponse(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    async def respond(handler, body):
        check_model(body.model)
        result = await handler.create(body)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest):
        return await respond(completions, body)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest):
        return await respond(chat, body)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "moe-runtime",
            "root": args.model, "max_model_len": engine.info.max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse(error_body(engine.dead, "EngineDeadError", 503), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": moe.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="checkpoint folder or 'tiny-qwen3-moe' "
                        "(or --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run_server(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    import uvicorn

    app = build_app(engine_args, args.served_model_name, args.api_key)
    logger.info("serving %s on http://%s:%d", engine_args.model, args.host, args.port)
    # SIGTERM / Ctrl-C: uvicorn stops accepting, lets in-flight requests finish, then the lifespan
    # shutdown stops the engine core.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=30)
    return 0


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def first_then_rest(agen):
    """Start an async iterator: its first item (so errors before any output become a status code)
    and an iterator of all items."""
    first = await agen.__anext__()

    async def chained():
        try:
            yield first
            async for item in agen:
                yield item
        finally:
            await agen.aclose()
    return chained()

