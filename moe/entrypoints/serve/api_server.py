"""`moe serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an engine core process.

Endpoints: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events),
/v1/models, /tokenize, /detokenize (tokenize_routes.py), /health and /ping (503 once the engine core is
gone; /ping, GET or POST, is SageMaker's name), /version, /metrics (Prometheus text).

Processes: with --api-server-count 1 (the default) the API process starts the engine core itself.
With N > 1 this process is a launcher: it starts the core, then N API processes (spawned) that
each bind the port with SO_REUSEPORT (the kernel spreads connections over them), each tokenising
and detokenising its own requests and connected to the core's socket. Their metrics go through
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR), so /metrics on any of them
gives the sums over all.

Every request passes `RequestGuard` first (request_guard.py): the API key (on every path but /health,
/ping and /version; /metrics too unless --metrics-without-api-key), then the body's size (--max-request-body-bytes)
and read deadline (--request-body-timeout), then, for a JSON body, that it is UTF-8 JSON without
duplicate keys. Each refusal is an OpenAI-style error body.

Shutdown (SIGTERM, or Ctrl-C): each API process drains (`Drain`): new requests get a 503 (the
socket stays open, so clients see why rather than a refused connection), those in flight get up to
--shutdown-timeout seconds, then streams still running end with an error event and `data: [DONE]`
and unanswered requests get a 503; then the engine core stops. A second Ctrl-C ends at once.

The launcher (N > 1) restarts an API process that dies (same index, same port and cores). A death
before any API process has served stops the service (a start-up failure), as do restarts too
frequent to be anything but a loop.
At start, `moe serve` removes what servers killed with SIGKILL left in /tmp and /dev/shm (never a
live server's: the owner's pid is in each name, and live shared-memory stores hold a flock).
"""
# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request is
# imported inside build_app) at run time.
import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import signal
import socket
import time
from collections import deque
from collections.abc import Mapping
from contextlib import asynccontextmanager

from moe.config import EngineArgs
from moe.engine.chat_template import read_chat_template
from moe.entrypoints.parsers import REASONING_PARSERS, TOOL_PARSERS
from moe.entrypoints.serve import protocol
from moe.entrypoints.serve.header_timeout import header_timeout_protocol
from moe.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, error_body
from moe.entrypoints.serve.request_guard import (DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_REQUEST_BODY_TIMEOUT_S,
                                                 DEFAULT_SHUTDOWN_TIMEOUT_S, END_GRACE_S, OPEN_PATHS, Drain,
                                                 RequestGuard)
from moe.gc_freeze import freeze_startup_heap, release_frozen_heap

logger = logging.getLogger("moe.entrypoints.serve")

API_KEY_ENV_VARS = ("MOE_API_KEY", "VLLM_API_KEY")  # read in this order when --api-key is not given
# The most samples (n) per request, read in this order; VLLM_MAX_N_SEQUENCES is vLLM's name.
MAX_N_ENV_VARS = ("MOE_MAX_N_SEQUENCES", "VLLM_MAX_N_SEQUENCES")
DEFAULT_REQUEST_HEADER_TIMEOUT_S = 30.0  # a connection without its headers by then is closed
_UVICORN_GRACE_S = 3.0  # then uvicorn's own wait for connections (a backstop: none should be left)
PROMETHEUS_FOLDER_PREFIX = "moe-prometheus-"
_STARTUP_FAILURE = 3  # the exit status uvicorn.run gives when the app does not start
_RESTART_LIMIT = 5  # API process restarts within _RESTART_WINDOW_S before the launcher gives up
_RESTART_WINDOW_S = 60.0


async def _until_stopped(agen, drain: Drain):
    """The items of the SSE stream `agen`, until the drain's stop: then an error event and [DONE]
    (closing `agen` aborts the request in the engine)."""
    stop = asyncio.ensure_future(drain.stop.wait())
    step = None
    try:
        while True:
            step = asyncio.ensure_future(agen.__anext__())
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                break
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
        yield sse({"error": drain.error()["error"]})
        yield sse("[DONE]")
    finally:
        stop.cancel()
        if step is not None and not step.done():  # aclose() may not run while __anext__ does
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await agen.aclose()


async def _client_hangs_up(request) -> None:
    """Returns when the client of `request` (a starlette Request whose body is read already, so that
    the next ASGI message is the disconnect) hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(args: EngineArgs, served_model_name: str | None = None, api_key: str | None = None,
              core_addresses: list[str] | None = None, core_pids: list[int] | None = None, server_index: int = 0,
              metrics_without_api_key: bool = False, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              request_body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S,
              shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S, max_n: int | None = None,
              chat_template: str | None = None, tool_settings=None, reasoning_parser: str | None = None):
    """The app of one API process. max_n, when given, becomes protocol.MAX_N (the most samples per
    request) for the whole process: each API process builds one app. chat_template: the template
    text that replaces the checkpoint's (--chat-template); tool_settings: a ToolSettings (the tool
    flags); reasoning_parser: the --reasoning-parser name."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    import moe
    from moe.dashboard import add_dashboard_routes
    from moe.engine.core_client import EngineDeadError
    from moe.entrypoints.serve.async_llm import AsyncLLM
    from moe.entrypoints.serve.chat_handler import ChatHandler
    from moe.entrypoints.serve.handlers import CompletionHandler
    from moe.entrypoints.serve.tokenize_routes import add_tokenize_routes

    if max_n is not None:
        protocol.MAX_N = max_n
    engine = AsyncLLM(args, core_addresses, core_pids, server_index)
    if chat_template is not None:
        engine.input.use_chat_template(chat_template)
    model_name = served_model_name or args.model

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        app.state.engine = engine
        freeze_startup_heap()  # as the engine's: no full garbage collection walks it mid-serving
        try:
            yield
        finally:
            release_frozen_heap()
            await engine.shutdown()

    app = FastAPI(title="moe-runtime", version=moe.__version__, lifespan=lifespan)
    drain = app.state.drain = Drain(shutdown_timeout_s)
    completions = CompletionHandler(engine, model_name)
    chat = ChatHandler(engine, model_name, tool_settings, reasoning_parser)

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
    app.add_middleware(RequestGuard, api_key=api_key, server_index=server_index, open_paths=open_paths,
                       max_body_bytes=max_request_body_bytes, body_timeout_s=request_body_timeout_s, drain=drain)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ErrorResponse(f"The model `{name}` does not exist.", 404, "NotFoundError", "model")

    async def respond(handler, body, request: Request):
        check_model(body.model)
        # Until the response starts, a client that hangs up cancels the work at once (its requests
        # are aborted); once streaming, the stream's own cancellation does that.
        task = asyncio.create_task(handler.create(body))
        hung_up = asyncio.create_task(_client_hangs_up(request))
        stopped = asyncio.create_task(drain.stop.wait())  # shutting down, and the drain's time is up
        try:
            await asyncio.wait({task, hung_up, stopped}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            for waiter in (hung_up, stopped):
                waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if drain.stop.is_set():
                return JSONResponse(drain.error(), status_code=503, headers={"connection": "close"})
            return Response(status_code=499)
        result = task.result()
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(_until_stopped(result, drain), media_type="text/event-stream")

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
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's SageMaker-style health check
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

    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":  # vLLM's development endpoints of sleep mode
        @app.post("/sleep")
        async def sleep(level: int = 1):
            return {"is_sleeping": bool(await engine.control("sleep", level)), "level": level}

        @app.post("/wake_up")
        async def wake_up():
            return {"is_sleeping": bool(await engine.control("wake_up"))}

        @app.get("/is_sleeping")
        async def is_sleeping():
            return {"is_sleeping": bool(await engine.control("is_sleeping"))}

    add_tokenize_routes(app, engine, check_model)

    # The live expert-load dashboard (/dashboard) over the windows the engine cores send.
    add_dashboard_routes(app, engine.expert_load_payload)
    return app


def resolve_max_n(environ: Mapping[str, str] = os.environ) -> int:
    """The most samples (n) one request may ask for: $MOE_MAX_N_SEQUENCES, else $VLLM_MAX_N_SEQUENCES
    (vLLM's name), else protocol.DEFAULT_MAX_N; a value that is not an integer >= 1 is refused at start."""
    for name in MAX_N_ENV_VARS:
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{name}={raw!r} must be an integer >= 1 (the most samples, n, per request)")
        return value
    return protocol.DEFAULT_MAX_N


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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="checkpoint folder or 'tiny-qwen3-moe' "
                        "(or --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send as `model` (default: %(default)s: the model as given)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health, /ping and /version "
                             "(not given: $MOE_API_KEY, else $VLLM_API_KEY, which keep the key out of ps)")
    parser.add_argument("--metrics-without-api-key", action="store_true",
                        help="serve /metrics without the API key (for a Prometheus scraper that sends none)")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="request bodies larger than this get 413, unread (default: %(default)s = 32 MiB)")
    parser.add_argument("--request-body-timeout", type=float, default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
                        help="seconds a client has to send a request's whole body after its headers; "
                             "then 408 and the connection is closed")
    parser.add_argument("--request-header-timeout", type=float, default=DEFAULT_REQUEST_HEADER_TIMEOUT_S,
                        help="seconds a client has to send a request's headers, from its connection or from the "
                             "first bytes of its next request on a kept-alive one; then 408 and the connection "
                             "is closed")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="API processes sharing the port (each tokenises and detokenises its own requests); "
                             "one that dies is restarted")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds that requests in flight at SIGTERM get to finish (new ones get 503 "
                             "meanwhile); then streams end with an error event and [DONE], other requests get "
                             "503, and the server exits")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template to render chats with, instead of the checkpoint's (for one that ships "
                             "none): a .jinja file, or the template text itself; a request's chat_template still "
                             "wins")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide when to call tools (tool_choice "auto", the default when a '
                             "request has tools): its calls are read from its text with --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the model family's tool-call format, read into OpenAI tool_calls: hermes (Qwen3's "
                             "<tool_call> blocks), deepseek_v3, pythonic / llama4_pythonic ([f(a=1)]), "
                             "llama3_json / llama4_json ({\"name\": ..., \"parameters\": ...})")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='leave a request\'s tools out of the chat template when its tool_choice is "none" '
                             "(by default the template describes them anyway)")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="put the text between the model's <think> and </think> into the reply's reasoning "
                             "(and reasoning_content), the rest into its content: deepseek_r1 or qwen3")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of uvicorn, the HTTP server (its access log at info and below)")


def run_server(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    if not args.request_body_timeout > 0:  # NaN too
        raise ValueError(f"--request-body-timeout must be > 0 seconds, got {args.request_body_timeout}")
    if not args.request_header_timeout > 0:
        raise ValueError(f"--request-header-timeout must be > 0 seconds, got {args.request_header_timeout}")
    if not (args.shutdown_timeout >= 0 and math.isfinite(args.shutdown_timeout)):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    args.api_key = resolve_api_key(args.api_key)  # before any process starts: the API processes get it resolved
    args.max_n = resolve_max_n()  # likewise
    if args.chat_template is not None:  # the text itself, read once: every API process renders with it
        args.chat_template = read_chat_template(args.chat_template)
    tool_settings_of(args)  # the tool flags checked before anything starts
    _reclaim_leftovers()
    if args.api_server_count > 1:
        return _run_launcher(args, engine_args)
    app = _build_app_from_args(args, engine_args)
    logger.info("serving %s on http://%s:%d", engine_args.model, args.host, args.port)
    return 0 if _serve(app, args) else _STARTUP_FAILURE


def _reclaim_leftovers() -> None:
    """Remove what killed servers left: /tmp/moe-core-*, /tmp/moe-prometheus-*, /dev/shm/moe_mm_*."""
    from moe.engine.core_client import CORE_FOLDER_PREFIX, reclaim_stale_temp_folders
    from moe.multimodal.shm_transport import reclaim_stale_stores

    removed = reclaim_stale_temp_folders((CORE_FOLDER_PREFIX, PROMETHEUS_FOLDER_PREFIX))
    removed += [f"/dev/shm/{name}" for name in reclaim_stale_stores()]
    if removed:
        logger.info("removed %d leftover(s) of server processes that were killed: %s", len(removed),
                    " ".join(removed))


def _serve(app, args: argparse.Namespace, sockets: list[socket.socket] | None = None, on_started=None) -> bool:
    """Run uvicorn on `app` until a signal ends it, draining first (see Drain); whether it started."""
    import uvicorn

    drain: Drain = app.state.drain

    class DrainingServer(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None
        drain_task: asyncio.Task | None = None

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and on_started is not None:
                on_started()

        def handle_exit(self, sig, frame):
            # Not uvicorn's: it would stop at once, and re-raise the signal after shutdown (a SIGTERM
            # exit status after a clean drain).
            if drain.draining or self.drain_task is not None:
                if sig == signal.SIGINT:  # Ctrl-C again: stop now
                    self.should_exit = self.force_exit = True
                return  # SIGTERM again (the launcher forwards one): the drain goes on
            if not self.started or self.loop is None:  # still starting: nothing to drain
                self.should_exit = True
                return
            self.loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self):
            if self.drain_task is None:
                drain.draining = True  # at once: a request arriving before the task runs gets its 503
                self.drain_task = self.loop.create_task(self._drain_then_exit())

        async def _drain_then_exit(self):
            try:
                await drain.run()
            finally:
                self.should_exit = True

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=_UVICORN_GRACE_S,
                            http=header_timeout_protocol(args.request_header_timeout))
    server = DrainingServer(config)
    server.run(sockets=sockets)
    return server.started


def _build_app_from_args(args: argparse.Namespace, engine_args: EngineArgs, core_addresses: list[str] | None = None,
                         core_pids: list[int] | None = None, server_index: int = 0):
    return build_app(engine_args, args.served_model_name, args.api_key, core_addresses, core_pids, server_index,
                     metrics_without_api_key=args.metrics_without_api_key,
                     max_request_body_bytes=args.max_request_body_bytes,
                     request_body_timeout_s=args.request_body_timeout, shutdown_timeout_s=args.shutdown_timeout,
                     max_n=getattr(args, "max_n", None), chat_template=getattr(args, "chat_template", None),
                     tool_settings=tool_settings_of(args), reasoning_parser=getattr(args, "reasoning_parser", None))


def tool_settings_of(args: argparse.Namespace):
    """The ToolSettings of the tool flags (a ValueError for flags that do not go together)."""
    from moe.entrypoints.serve.tool_choice import ToolSettings

    return ToolSettings(getattr(args, "enable_auto_tool_choice", False), getattr(args, "tool_call_parser", None),
                        getattr(args, "exclude_tools_when_tool_choice_none", False))


def _reuseport_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _api_server_main(args: argparse.Namespace, engine_args: EngineArgs, index: int, addresses: list[str],
                     core_pids: list[int], ready=None) -> None:
    """One of N API processes (spawned by the launcher); `ready` (a shared byte) is set to 1 once it serves."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    app = _build_app_from_args(args, engine_args, addresses, core_pids, index)

    def started():
        if ready is not None:
            ready.value = 1

    _serve(app, args, sockets=[_reuseport_socket(args.host, args.port)], on_started=started)


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _forget_api_process(pid: int) -> None:
    """Clean up after an API process that died: its live gauges, its shared-memory stores (removed
    here unless an engine core still pins them; the core removes those once their requests end)."""
    from multiprocessing import resource_tracker

    from prometheus_client import multiprocess

    from moe.multimodal.shm_transport import STORE_PREFIX, reclaim_stale_stores

    multiprocess.mark_process_dead(pid)
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(f"{STORE_PREFIX}{pid}_")]
    except OSError:
        names = []
    for name in names:
        # The resource tracker (shared with the API processes) would unlink them at exit and warn of
        # a leak, or of a name already gone: they are removed here or by the core instead.
        resource_tracker.unregister(f"/{name}", "shared_memory")
    reclaim_stale_stores()


def _run_launcher(args: argparse.Namespace, engine_args: EngineArgs) -> int:
    import multiprocessing

    from moe.engine.core_client import launch_cores, owned_temp_folder

    # Before any API process imports prometheus_client: they all write to this folder.
    metrics_dir = owned_temp_folder(PROMETHEUS_FOLDER_PREFIX)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    cores, addresses = launch_cores(engine_args)
    core_pids = [c.pid for c in cores]
    ctx = multiprocessing.get_context("spawn")
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})  # plain values to pickle

    def start(index: int):
        # A byte of shared memory, not an Event: an Event's named semaphores would stay in /dev/shm
        # after a SIGKILL of the process group (its resource tracker dies too).
        ready = ctx.RawValue("b", 0)
        p = ctx.Process(target=_api_server_main, args=(args, engine_args, index, addresses, core_pids, ready),
                        name=f"moe-api-server-{index}")
        p.start()
        return p, ready

    servers = [start(i) for i in range(args.api_server_count)]
    logger.info("serving %s on http://%s:%d with %d API processes (engine core pids %s)", engine_args.model,
                args.host, args.port, len(servers), core_pids)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    status = 0
    restarts: deque[float] = deque()  # when API processes were restarted, within _RESTART_WINDOW_S
    try:
        while not stopping:
            for core in cores:
                core.poll()  # reaps a dead core, so that the API processes see it gone
            for i, (p, _ready) in enumerate(servers):
                if stopping or p.is_alive():
                    continue
                how = _exit_description(p.exitcode)
                _forget_api_process(p.pid)
                if not any(r.value for _, r in servers):  # the service never came up: no use retrying
                    logger.error("API process %d exited while starting (%s): stopping", i, how)
                    status = 1
                    stopping.append(True)
                    break
                now = time.monotonic()
                while restarts and now - restarts[0] > _RESTART_WINDOW_S:
                    restarts.popleft()
                if len(restarts) >= _RESTART_LIMIT:
                    logger.error("API process %d exited (%s): %d API process deaths within %.0f s look like a "
                                 "crash loop: stopping", i, how, len(restarts) + 1, _RESTART_WINDOW_S)
                    status = 1
                    stopping.append(True)
                    break
                restarts.append(now)
                servers[i] = start(i)
                logger.error("API process %d (pid %d) exited (%s): restarted it as pid %d; the other API "
                             "processes serve meanwhile", i, p.pid, how, servers[i][0].pid)
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        # Ctrl-C reached the API processes too, and they drain; a second one stops them (not this loop).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p, _ in servers:  # the API processes drain their requests first
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + args.shutdown_timeout + END_GRACE_S + 15
        for p, _ in servers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                logger.warning("API process %s did not stop after its drain: killed", p.name)
                p.kill()
                p.join(5)
        for core in cores:
            if core.poll() is None:
                core.terminate()
        for core in cores:
            try:
                core.wait(10)
            except Exception:
                core.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        _reclaim_leftovers()  # the stores of API processes killed on the way
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

