"""`moe serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an engine core process.

Endpoints: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events),
/v1/models, /health (503 once the engine core is gone), /version, /metrics (Prometheus text).

Processes: with --api-server-count 1 (the default) the API process starts the engine core itself.
With N > 1 this process is a launcher: it starts the core, then N API processes (spawned) that
each bind the port with SO_REUSEPORT (the kernel spreads connections over them), each tokenising
and detokenising its own requests and connected to the core's socket. Their metrics go through
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR), so /metrics on any of them
gives the sums over all.

Every request passes `_RequestGuard` first: the API key (on every path but /health and /version;
/metrics too unless --metrics-without-api-key), then the body's size (--max-request-body-bytes)
and read deadline (--request-body-timeout), then, for a JSON body, that it is UTF-8 JSON without
duplicate keys. Each refusal is an OpenAI-style error body.
"""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request is
# imported inside build_app) at run time.
import argparse
import asyncio
import base64
import binascii
import hmac
import json
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager

from moe.config import EngineArgs
from moe.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, error_body

logger = logging.getLogger("moe.entrypoints.serve")

_DISCONNECT_POLL_S = 0.25  # how often a request that has not started its response checks its client

# Paths open without the API key: liveness probes and load balancers send none, and these tell nothing.
OPEN_PATHS = frozenset({"/health", "/version"})
API_KEY_ENV_VARS = ("MOE_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key is not given
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20  # room for a few base64 images in a chat request
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# Bodies larger than this are checked for JSON in a worker thread, so that the event loop keeps
# streaming the other requests' tokens meanwhile.
_JSON_CHECK_IN_THREAD_BYTES = 1 << 20


def build_app(args: EngineArgs, served_model_name: str | None = None, api_key: str | None = None,
              core_addresses: list[str] | None = None, core_pids: list[int] | None = None, server_index: int = 0,
              metrics_without_api_key: bool = False, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S):
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

    open_paths = (OPEN_PATHS | {"/metrics"}) if metrics_without_api_key else OPEN_PATHS
    app.add_middleware(_RequestGuard, api_key=api_key, server_index=server_index, open_paths=open_paths,
                       max_body_bytes=max_request_body_bytes, body_timeout_s=request_body_timeout_s)

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


def resolve_api_key(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The API key: --api-key, else $MOE_API_KEY, else $VLLM_API_KEY (vLLM's name); None: no key.
    An environment variable keeps the key out of `ps`. A key that no client could send (empty, not
    printable ASCII, surrounding spaces, which HTTP strips from a header) is refused at start."""
    source, key = "--api-key", flag
    if key is None:
        source, key = next(((name, environ[name]) for name in API_KEY_ENV_VARS if name in environ), (None, None))
        if key is None:
            return None
    if not key:
        undo = "leave --api-key out" if source == "--api-key" else f"unset {source}"
        raise ValueError(f"{source} is empty: give a key, or {undo} to serve without one")
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ValueError(f"{source} must be printable ASCII without leading or trailing spaces "
                         f"(clients send it in an HTTP header)")
    return key


class _BadJSON(ValueError):
    pass


def _no_duplicate_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # json.loads would keep the last value silently
        seen = set()
        for key, _ in pairs:
            if key in seen:
                # json.dumps escapes what is not ASCII (lone surrogates too): the message stays encodable.
                shown = json.dumps(key)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise _BadJSON(f"the request body has the key {shown} twice in one object")
            seen.add(key)
    return obj


def _no_constant(name: str):
    raise _BadJSON(f"the request body is not valid JSON: {name} is not a JSON value")


def json_body_problem(body: bytes) -> str | None:
    """Why `body` is not one UTF-8 JSON text without duplicate keys, or None. (FastAPI would parse
    a non-UTF-8 body by guessing its encoding, keep the last of duplicate keys, accept NaN, and
    answer a bare {"detail"} to what it cannot decode.)"""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the request body is not valid UTF-8: {e.reason} at byte {e.start}"
    try:
        json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except _BadJSON as e:
        return str(e)
    except json.JSONDecodeError as e:
        return f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})"
    except RecursionError:
        return "the request body is not valid JSON here: its arrays or objects nest too deeply"
    except ValueError as e:  # an integer of more digits than Python converts; the hint after ';' is for Python users
        return f"the request body is not valid JSON here: {str(e).split(';')[0]}"
    return None


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether FastAPI parses this body as JSON: content-type application/json or application/*+json."""
    ctype = next((v for k, v in headers if k == b"content-type"), b"")
    media = ctype.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    value = next((v for k, v in headers if k == b"content-length"), None)
    try:
        return None if value is None else int(value)
    except ValueError:  # the HTTP parser refuses such a request before it gets here
        return None


class _Refusal(Exception):
    def __init__(self, status: int, message: str, err_type: str, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.close = status, message, err_type, close


class _RequestGuard:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides a client's disconnect from the
    handlers). In order: the API key (before any body is read, so that a client without it cannot
    make the server buffer anything), the body's size and read deadline, the body's JSON; and every
    response names the API process in a header.

    The body is read whole here (FastAPI reads it whole anyway, before the handler runs) and handed
    on as one message; later receive() calls go to the server, so a client's disconnect still shows."""

    def __init__(self, app, api_key: str | None, server_index: int, open_paths: frozenset[str] = OPEN_PATHS,
                 max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S) -> None:
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.open_paths = open_paths
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.index_header = (b"x-moe-api-server", str(server_index).encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_index(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.index_header]
            await send(message)

        try:
            if self.key is not None and scope["path"] not in self.open_paths:
                self._check_key(scope)
            body = await self._read_body(scope, receive)
            if body is None:
                return  # the client hung up while sending
            if body and _is_json(scope["headers"]):
                if len(body) > _JSON_CHECK_IN_THREAD_BYTES:
                    problem = await asyncio.to_thread(json_body_problem, body)
                else:
                    problem = json_body_problem(body)
                if problem is not None:
                    raise _Refusal(400, problem, "BadRequestError")
        except _Refusal as r:
            return await self._refuse(r, scope, receive, send_with_index)

        pending = [body]

        async def receive_body_then_server():
            if pending:
                return {"type": "http.request", "body": pending.pop(), "more_body": False}
            return await receive()

        await self.app(scope, receive_body_then_server, send_with_index)

    def _check_key(self, scope) -> None:
        values = [v for k, v in scope["headers"] if k == b"authorization"]
        if not values:
            raise _Refusal(401, "missing API key: send the header 'Authorization: Bearer <key>'", "AuthenticationError")
        if len(values) > 1:  # which one would a proxy in front have checked?
            raise _Refusal(401, "more than one Authorization header", "AuthenticationError")
        scheme, _, credentials = values[0].strip().partition(b" ")
        scheme, credentials = scheme.lower(), credentials.strip()
        if scheme == b"basic":
            # What a browser sends after its login prompt (the key as the password, any user name),
            # so that /dashboard and /docs open in one. Read-only methods only: a browser also sends
            # it unasked with the requests that other web pages make to this server.
            if scope["method"] not in ("GET", "HEAD"):
                raise _Refusal(401, "Basic credentials are accepted on GET requests only: send the header "
                               "'Authorization: Bearer <key>'", "AuthenticationError")
            try:
                credentials = base64.b64decode(credentials, validate=True).partition(b":")[2]
            except binascii.Error:
                credentials = b""
        elif scheme != b"bearer":
            raise _Refusal(401, "unsupported Authorization scheme: send the header 'Authorization: Bearer <key>'",
                           "AuthenticationError")
        # Constant time: how long the comparison takes tells nothing of how much of the key matched.
        if not credentials or not hmac.compare_digest(credentials, self.key):
            raise _Refusal(401, "invalid API key", "AuthenticationError")

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None if the client hung up; _Refusal when it is too large or too slow.
        The limit is checked on Content-Length before reading anything, and on the bytes counted so
        far while reading (a chunked upload has no Content-Length)."""
        declared = _content_length(scope["headers"])
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large(f"the request body ({declared} bytes)")
        chunks, size, more = [], 0, True
        # One deadline for the whole body, not one per chunk: a client trickling a byte now and
        # then must not hold its connection (and its buffer) forever.
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise _Refusal(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               "RequestTimeoutError", close=True) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large("the request body")
            chunks.append(chunk)
            more = message.get("more_body", False)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large(self, what: str) -> _Refusal:
        return _Refusal(413, f"{what} is larger than this server's limit of {self.max_body_bytes} bytes",
                        "RequestTooLargeError", close=True)

    async def _refuse(self, r: _Refusal, scope, receive, send) -> None:
        from fastapi.responses import JSONResponse

        response = JSONResponse(error_body(r.message, r.err_type, r.status), status_code=r.status)
        if r.status == 401:  # the schemes accepted (RFC 9110 asks for them on a 401)
            response.raw_headers.append((b"www-authenticate", b'Bearer realm="moe-runtime"'))
            if scope["method"] in ("GET", "HEAD"):
                response.raw_headers.append((b"www-authenticate", b'Basic realm="moe-runtime", charset="UTF-8"'))
        if r.close:  # the rest of the body stays unread: the connection cannot carry another request
            response.raw_headers.append((b"connection", b"close"))
        await response(scope, receive, send)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="checkpoint folder or 'tiny-qwen3-moe' "
                        "(or --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health and /version "
                             "(not given: $MOE_API_KEY, else $VLLM_API_KEY, which keep the key out of ps)")
    parser.add_argument("--metrics-without-api-key", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper that sends none)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="request bodies larger than this get 413, unread (default: %(default)s = 32 MiB)")
    parser.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        help="seconds a client has to send a request's whole body after its headers; "
                             "then 408 and the connection is closed")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API processes sharing the port (each tokenises and detokenises its own requests)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])


def run_server(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    import uvicorn

    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if not args.request_body_timeout > 0:  # NaN too
        raise ValueError(f"--request-body-timeout must be > 0 seconds, got {args.request_body_timeout}")
    args.api_key = resolve_api_key(args.api_key)  # before any process starts: the API processes get it resolved
    if args.api_server_count > 1:
        return _run_launcher(args, engine_args)
    app = _build_app_from_args(args, engine_args)
    logger.info("serving %s on http://%s:%d", engine_args.model, args.host, args.port)
    # SIGTERM / Ctrl-C: uvicorn stops accepting, lets in-flight requests finish, then the lifespan
    # shutdown stops the engine core.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=30)
    return 0


def _build_app_from_args(args: argparse.Namespace, engine_args: EngineArgs, core_addresses: list[str] | None = None,
                         core_pids: list[int] | None = None, server_index: int = 0):
    return build_app(engine_args, args.served_model_name, args.api_key, core_addresses, core_pids, server_index,
                     metrics_without_api_key=args.metrics_without_api_key,
                     max_request_body_bytes=args.max_request_body_bytes,
                     request_body_timeout_s=args.request_body_timeout)


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
    app = _build_app_from_args(args, engine_args, addresses, core_pids, index)
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

