"""What every HTTP request of `moe serve` passes before a handler sees it (`RequestGuard`, plain ASGI
middleware): the API key, the body's size and read deadline, the body's JSON; and the drain at
shutdown (`Drain`), which the guard counts requests for and refuses new ones under.
"""
import asyncio
import base64
import binascii
import hmac
import json
import logging

from moe.entrypoints.serve.protocol import error_body

logger = logging.getLogger("moe.entrypoints.serve")

# Paths open without the API key: liveness probes and load balancers send none, and these tell nothing.
OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20  # room for a few base64 images in a chat request
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0
# Bodies larger than this are checked for JSON in a worker thread, so that the event loop keeps
# streaming the other requests' tokens meanwhile.
_JSON_CHECK_IN_THREAD_BYTES = 1 << 20
# 25 s of drain leaves room, within Kubernetes' default 30 s grace before SIGKILL, to end what is
# left with an error event and to stop the engine core.
DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0
END_GRACE_S = 5.0  # after the drain: time for the requests told to end to send their last bytes


class Drain:
    """What SIGTERM starts in an API process (see _serve): new requests are refused with a 503, the
    ones in flight get timeout_s to finish, then `stop` is set and they end at once (a stream with an
    error event and [DONE], a request not yet answered with a 503)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0  # HTTP requests inside RequestGuard
        self.stop = asyncio.Event()

    def error(self) -> dict:
        return error_body(f"the server is shutting down: this request did not finish within the "
                          f"{self.timeout_s:g} s it had (--shutdown-timeout)", "ServiceUnavailableError", 503)

    async def _until_idle(self, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight

    async def run(self) -> None:
        self.draining = True
        logger.info("shutting down: new requests get 503; %d in flight get up to %g s to finish",
                    self.in_flight, self.timeout_s)
        if not await self._until_idle(self.timeout_s):
            logger.warning("shutting down: %d request(s) still running after %g s (--shutdown-timeout): "
                           "ending them with a 503 error", self.in_flight, self.timeout_s)
            self.stop.set()
            await self._until_idle(END_GRACE_S)


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


class RequestGuard:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides a client's disconnect from the
    handlers). In order: the API key (before any body is read, so that a client without it cannot
    make the server buffer anything), the body's size and read deadline, the body's JSON; and every
    response names the API process in a header. While the server drains for shutdown every new
    request gets a 503; the others are counted, for the drain to know when none is left.

    The body is read whole here (FastAPI reads it whole anyway, before the handler runs) and handed
    on as one message; later receive() calls go to the server, so a client's disconnect still shows."""

    def __init__(self, app, api_key: str | None, server_index: int, open_paths: frozenset[str] = OPEN_PATHS,
                 max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_REQUEST_BODY_TIMEOUT_S, drain: Drain | None = None) -> None:
        self.app = app
        self.drain = drain if drain is not None else Drain(DEFAULT_SHUTDOWN_TIMEOUT_S)
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

        if self.drain.draining:
            return await self._refuse(_Refusal(503, "the server is shutting down: send the request to another "
                                               "server, or again once it is back", "ServiceUnavailableError",
                                               close=True), scope, receive, send_with_index)
        self.drain.in_flight += 1
        try:
            await self._guarded(scope, receive, send_with_index)
        finally:
            self.drain.in_flight -= 1

    async def _guarded(self, scope, receive, send_with_index):
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        # A body still arriving when the shutdown drain's time is up must not hold the exit back.
        stop = asyncio.ensure_future(self.drain.stop.wait())
        try:
            while more:
                step = asyncio.ensure_future(receive())
                await asyncio.wait({step, stop}, timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    if stop.done():
                        raise _Refusal(503, self.drain.error()["error"]["message"], "ServiceUnavailableError",
                                       close=True)
                    raise _Refusal(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                   "RequestTimeoutError", close=True)
                message = step.result()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise self._too_large("the request body")
                chunks.append(chunk)
                more = message.get("more_body", False)
        finally:
            stop.cancel()
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
