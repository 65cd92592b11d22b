"""`moe serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an engine core process.

Endpoints: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events),
/v1/models, /health (503 once the engine core is gone), /version, /metrics (Prometheus text).

Processes: with --api-server-count 1 (the default) the API process starts the engine core itself.
With N > 1 this process is a launcher: it starts the core, then N API processes (spawned) that
each bind the port with SO_REUSEPORT (the kernel spreads connections over them), each tokenising
and detokenising its own requests and connected to the core's socket. Their metrics go through
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR), so /metrics on any of them
gives the sums over all.
"""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request is
# imported inside build_app) at run time.
import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import tempfile
import time
from contextlib import asynccontextmanager

from moe.config import EngineArgs
from moe.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, error_body

logger = logging.getLogger("moe.entrypoints.serve")

_DISCONNECT_POLL_S = 0.25  # how often a request that has not started its response checks its client


def build_app(args: EngineArgs, served_model_name: str | None = None, api_key: str | None = None,
              core_addresses: list[str] | None = None, core_pids: list[int] | None = None, server_index: int = 0):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    import moe
    from moe.dashboard import add_dashboard_routes
    from moe.engine.core_client import EngineDeadError
    from moe.entrypoints.serve.async_llm import AsyncLLM
    from moe.entrypoints.serve.handlers import ChatHandler, CompletionHandler

    engine = AsyncLLM(args, core_addresses, core_pids, server_index)
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

    app.add_middleware(_AuthAndServerIndex, api_key=api_key, server_index=server_index)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ErrorResponse(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    async def respond(handler, body, request: Request):
        check_model(body.model)
        # Until the response starts, a client that hangs up cancels the work (its requests are
        # aborted); once streaming, the stream's own cancellation does that.
        task = asyncio.create_task(handler.create(body))
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                break
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return Response(status_code=499)
        result = task.result()
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await respond(completions, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await respond(chat, body, request)

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
        registry = engine.metrics.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import CollectorRegistry, multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    # The live expert-load dashboard (/dashboard) over the windows the engine cores send.
    add_dashboard_routes(app, engine.expert_load_payload)
    return app


class _AuthAndServerIndex:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides a client's disconnect from the
    handlers): checks the API key on /v1 paths and names the API process in a response header."""

    def __init__(self, app, api_key: str | None, server_index: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.index_header = (b"x-moe-api-server", str(server_index).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected is not None and scope["path"].startswith("/v1"):
            if dict(scope["headers"]).get(b"authorization") != self.expected:
                from fastapi.responses import JSONResponse

                response = JSONResponse(error_body("invalid or missing API key", "AuthenticationError", 401),
                                        status_code=401)
                return await response(scope, receive, send)

        async def send_with_index(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.index_header]
            await send(message)

        await self.app(scope, receive, send_with_index)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="checkpoint folder or 'tiny-qwen3-moe' "
                        "(or --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API processes sharing the port (each tokenises and detokenises its own requests)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run_server(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    import uvicorn

    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        return _run_launcher(args, engine_args)
    app = build_app(engine_args, args.served_model_name, args.api_key)
    logger.info("serving %s on http://%s:%d", engine_args.model, args.host, args.port)
    # SIGTERM / Ctrl-C: uvicorn stops accepting, lets in-flight requests finish, then the lifespan
    # shutdown stops the engine core.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=30)
    return 0


def _reuseport_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _api_server_main(args: argparse.Namespace, engine_args: EngineArgs, index: int, addresses: list[str],
                     core_pids: list[int]) -> None:
    """One of N API processes (spawned by the launcher)."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    app = build_app(engine_args, args.served_model_name, args.api_key, addresses, core_pids, index)
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=30)
    uvicorn.Server(config).run(sockets=[_reuseport_socket(args.host, args.port)])


def _run_launcher(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    import multiprocessing

    from moe.engine.core_client import launch_cores

    # Before any API process imports prometheus_client: they all write to this folder.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="moe-prometheus-")
    cores, addresses = launch_cores(engine_args)
    ctx = multiprocessing.get_context("spawn")
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})  # plain values to pickle
    servers = [ctx.Process(target=_api_server_main, args=(args, engine_args, i, addresses, [c.pid for c in cores]),
                           name=f"moe-api-server-{i}") for i in range(args.api_server_count)]
    for p in servers:
        p.start()
    logger.info("serving %s on http://%s:%d with %d API processes (engine core pids %s)", engine_args.model,
                args.host, args.port, len(servers), [c.pid for c in cores])
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    status = 0
    try:
        while not stopping:
            for core in cores:
                core.poll()  # reaps a dead core, so that the API processes see it gone
            if any(not p.is_alive() for p in servers):
                logger.error("an API process exited: stopping")
                status = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for p in servers:  # the API processes drain their requests first
            if p.is_alive():
                p.terminate()
        for p in servers:
            p.join(35)
            if p.is_alive():
                p.kill()
        for core in cores:
            if core.poll() is None:
                core.terminate()
        for core in cores:
            try:
                core.wait(10)
            except Exception:
                core.kill()
    return status


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

