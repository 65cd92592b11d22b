"""The request-header deadline (moe/entrypoints/serve/header_timeout.py) on a real uvicorn server:
a client that sends nothing, or half a request, is answered 408 and disconnected; a complete
request, a slow body (the API server's own deadline) and a kept-alive connection's next request
are untouched."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from moe.entrypoints.serve.header_timeout import header_timeout_protocol
from tests.serve.helpers import free_port

TIMEOUT_S = 0.5


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    port = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning",
                            http=header_timeout_protocol(TIMEOUT_S), timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket, wait_s: float) -> bytes:
    """What the server sends until it closes the connection (or wait_s passes)."""
    sock.settimeout(wait_s)
    out = b""
    try:
        while chunk := sock.recv(4096):
            out += chunk
    except TimeoutError:
        pass
    return out


def _read_response(sock: socket.socket) -> bytes:
    """One whole response: its headers, then content-length bytes of body."""
    sock.settimeout(5)
    out = b""
    while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < _content_length(out):
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection mid-response: {out!r}"
        out += chunk
    return out


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _request(body: bytes = b"hi") -> bytes:
    return b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


@pytest.mark.parametrize("sent", [b"", b"GET / HT", b"POST / HTTP/1.1\r\nhost: x\r\n"])
def test_incomplete_headers_get_408_and_the_connection_closes(port, sent):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(sent)
        t0 = time.monotonic()
        reply = _read_all(sock, wait_s=5 * TIMEOUT_S + 2)
        waited = time.monotonic() - t0
    assert reply.startswith(b"HTTP/1.1 408 ") and reply.endswith(b"did not arrive in time")
    assert TIMEOUT_S * 0.8 <= waited < TIMEOUT_S + 2  # closed by the deadline, not by the read timeout


def test_complete_requests_and_slow_bodies_are_untouched(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nab")
        time.sleep(3 * TIMEOUT_S)  # the headers are in: only the body is late
        sock.sendall(b"cd")
        reply = _read_response(sock)
    assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"abcd")


def test_a_kept_alive_connections_next_request_has_the_deadline_too(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(_request(b"one"))
        assert _read_response(sock).endswith(b"one")
        time.sleep(3 * TIMEOUT_S)  # idle between requests: keep-alive's business (30 s), not a timeout
        sock.sendall(_request(b"two"))
        assert _read_response(sock).endswith(b"two")
        sock.sendall(b"POST / HTTP/1.1\r\nhost")  # the third request stalls in its headers
        reply = _read_all(sock, wait_s=5 * TIMEOUT_S + 2)
    assert reply.startswith(b"HTTP/1.1 408 ")


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_the_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="request-header timeout must be > 0"):
        header_timeout_protocol(bad)


def test_moe_serve_closes_a_connection_without_headers(model_dir, tmp_path):
    """The flag reaches `moe serve`'s uvicorn: half a request line, 408 after --request-header-timeout."""
    from tests.serve.helpers import ServerProcess
    srv = ServerProcess(model_dir, str(tmp_path / "serve.log"), extra=["--request-header-timeout", "1"])
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(b"GET /health HT")
            t0 = time.monotonic()
            reply = _read_all(sock, wait_s=8)
            waited = time.monotonic() - t0
        assert reply.startswith(b"HTTP/1.1 408 ") and 0.8 <= waited < 4, (reply, waited)
    finally:
        srv.stop()
