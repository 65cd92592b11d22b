"""`moe serve` against hostile or careless clients, on loopback: the API key on every path but
/health and /version (the flag before $MOE_API_KEY before $VLLM_API_KEY; /metrics open only with
--metrics-without-api-key), request bodies over --max-request-body-bytes refused unread (413),
bodies that stall past --request-body-timeout answered 408 and closed (raw sockets), and bodies
that are not UTF-8 JSON or repeat a key refused with a 400 naming the problem.

Two servers, started side by side: `server` (--api-key, a 64 KiB body limit, a 1 s body timeout)
and `env_server` (its key from the environment only, /metrics open)."""
from __future__ import annotations

import json
import selectors
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moe.entrypoints.serve.api_server import resolve_api_key
from moe.entrypoints.serve.request_guard import json_body_problem
from tests.serve.helpers import API_KEY, MODEL_NAME, ServerProcess, headers

BODY_LIMIT = 64 * 1024
BODY_TIMEOUT_S = 1.0
MOE_KEY, VLLM_KEY = "moe-env-key", "vllm-env-key"
COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("log")

    def flag_server():
        # --api-key and MOE_API_KEY both: the flag must win.
        return ServerProcess(model_dir, str(logs / "flag.log"), env={"MOE_API_KEY": MOE_KEY}, extra=[
            "--max-request-body-bytes", str(BODY_LIMIT), "--request-body-timeout", str(BODY_TIMEOUT_S)])

    def env_server():
        # No --api-key: the key comes from the environment alone (MOE_API_KEY over VLLM_API_KEY).
        return ServerProcess(model_dir, str(logs / "env.log"), api_key=None,
                             env={"MOE_API_KEY": MOE_KEY, "VLLM_API_KEY": VLLM_KEY},
                             extra=["--metrics-without-api-key"])

    # Side by side: each takes seconds to load the model.
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(flag_server), pool.submit(env_server)]
        started = [f.exception() or f.result() for f in futures]
    if any(isinstance(s, BaseException) for s in started):
        for s in started:
            if isinstance(s, ServerProcess):
                s.stop()
        raise next(s for s in started if isinstance(s, BaseException))
    yield started
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def env_server(servers):
    return servers[1]


def assert_error(r: httpx.Response, status: int, err_type: str, match: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["object"] == "error" and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["code"] == status and err["type"] == err_type and match in err["message"], err


# --- the API key -------------------------------------------------------------------------------


def test_api_key_resolution_flag_then_moe_then_vllm():
    both = {"MOE_API_KEY": MOE_KEY, "VLLM_API_KEY": VLLM_KEY}
    assert resolve_api_key("flag-key", both) == "flag-key"
    assert resolve_api_key(None, both) == MOE_KEY
    assert resolve_api_key(None, {"VLLM_API_KEY": VLLM_KEY}) == VLLM_KEY
    assert resolve_api_key(None, {}) is None
    # A key no client could send fails at start, naming where it came from.
    for flag, env, name in [("", {}, "--api-key"), (None, {"MOE_API_KEY": ""}, "MOE_API_KEY"),
                            (None, {"VLLM_API_KEY": "key\n"}, "VLLM_API_KEY"), (" key", {}, "--api-key"),
                            ("kéy", {}, "--api-key")]:
        with pytest.raises(ValueError, match=name):
            resolve_api_key(flag, env)


PROTECTED = ["/v1/models", "/metrics", "/dashboard", "/dashboard/", "/dashboard/data.json", "/docs", "/redoc",
             "/openapi.json", "/no-such-page"]


@pytest.mark.parametrize("path", PROTECTED)
def test_every_path_but_health_and_version_needs_the_key(server, path):
    url = f"{server.url}{path}"
    r = httpx.get(url, timeout=10)
    assert_error(r, 401, "AuthenticationError", "missing API key")
    assert 'Bearer realm="moe-runtime"' in r.headers.get_list("www-authenticate")
    assert r.headers["x-moe-api-server"] == "0"
    for wrong in ("Bearer wrong", f"Bearer {MOE_KEY}", f"Bearer {API_KEY}x", f"Token {API_KEY}"):
        assert httpx.get(url, headers={"Authorization": wrong}, timeout=10).status_code == 401, wrong
    r = httpx.get(url, headers=headers(), timeout=10)
    assert r.status_code == (404 if path == "/no-such-page" else 200), r.text


def test_health_and_version_are_open_and_posts_need_the_key(server):
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{server.url}/version", timeout=5).json()["version"]
    r = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=10)
    assert_error(r, 401, "AuthenticationError", "missing API key")
    r = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=10,
                   headers=[("Authorization", f"Bearer {API_KEY}"), ("Authorization", "Bearer other")])
    assert_error(r, 401, "AuthenticationError", "more than one Authorization header")
    r = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=headers(), timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_basic_credentials_open_the_dashboard_in_a_browser_but_post_nothing(server):
    r = httpx.get(f"{server.url}/dashboard/", timeout=10)
    assert any(c.startswith("Basic ") for c in r.headers.get_list("www-authenticate"))  # the browser's login prompt
    assert httpx.get(f"{server.url}/dashboard/data.json", auth=("anyone", API_KEY), timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/dashboard/data.json", auth=("anyone", "wrong"), timeout=10).status_code == 401
    r = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, auth=("anyone", API_KEY), timeout=10)
    assert_error(r, 401, "AuthenticationError", "GET requests only")


def test_key_from_the_environment_and_metrics_open_by_flag(env_server):
    url = env_server.url
    r = httpx.get(f"{url}/metrics", timeout=10)  # --metrics-without-api-key
    assert r.status_code == 200 and "moe:request_success_total" in r.text
    assert_error(httpx.get(f"{url}/v1/models", timeout=10), 401, "AuthenticationError", "missing API key")
    assert httpx.get(f"{url}/dashboard/data.json", timeout=10).status_code == 401  # only /metrics opened
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {MOE_KEY}"}, timeout=10).status_code == 200
    # $MOE_API_KEY wins over $VLLM_API_KEY
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {VLLM_KEY}"}, timeout=10).status_code == 401


# --- raw sockets -------------------------------------------------------------------------------


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def request_head(path: str = "/v1/completions", **fields: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {API_KEY}",
             "Content-Type: application/json"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection; fails after timeout_s."""
    sock.settimeout(timeout_s)
    data, deadline = b"", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with bytes of ours unread: what it sent before is in `data`
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the server did not close the connection within {timeout_s} s; got {data!r}")


def parse_response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    hdrs = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), hdrs, json.loads(body)


def assert_refused(raw: bytes, status: int, err_type: str, match: str) -> None:
    code, hdrs, body = parse_response(raw)
    assert code == status and hdrs.get("connection") == "close", raw
    assert body["error"]["type"] == err_type and match in body["error"]["message"] and body["error"]["code"] == status


def test_content_length_over_the_limit_is_413_before_any_body(server):
    with connect(server) as sock:
        t0 = time.monotonic()
        sock.sendall(request_head(content_length=str(BODY_LIMIT + 1)))  # and no body at all
        raw = read_until_closed(sock, 5)
        # Answered at once: it did not wait for the body (the body timeout is 1 s).
        assert time.monotonic() - t0 < BODY_TIMEOUT_S / 2
    assert_refused(raw, 413, "RequestTooLargeError", f"({BODY_LIMIT + 1} bytes) is larger than this server's limit "
                                                     f"of {BODY_LIMIT} bytes")


def test_chunked_body_over_the_limit_is_413(server):
    piece = b"x" * (16 * 1024)
    with connect(server) as sock:
        sock.sendall(request_head(transfer_encoding="chunked"))
        for _ in range(BODY_LIMIT // len(piece) + 1):  # one piece over, and no end of body
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        raw = read_until_closed(sock, 5)
    assert_refused(raw, 413, "RequestTooLargeError", f"limit of {BODY_LIMIT} bytes")


def test_bodies_up_to_the_limit_are_served_chunked_and_slow_too(server):
    body = json.dumps(COMPLETION).encode()
    exact = body + b" " * (BODY_LIMIT - len(body))  # JSON may end in spaces: exactly the limit
    r = httpx.post(f"{server.url}/v1/completions", content=exact, timeout=30,
                   headers={**headers(), "content-type": "application/json"})
    assert r.status_code == 200, r.text

    def slow_pieces():  # chunked (no Content-Length), within the 1 s deadline
        for i in range(0, len(body), len(body) // 3 + 1):
            time.sleep(0.15)
            yield body[i:i + len(body) // 3 + 1]

    r = httpx.post(f"{server.url}/v1/completions", content=slow_pieces(), timeout=30,
                   headers={**headers(), "content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_stalled_body_is_408_and_closed_within_the_timeout(server):
    with connect(server) as sock:
        sock.sendall(request_head(content_length="100") + b'{"model": ')  # then nothing
        t0 = time.monotonic()
        raw = read_until_closed(sock, 5)
        waited = time.monotonic() - t0
    assert BODY_TIMEOUT_S - 0.1 < waited < BODY_TIMEOUT_S + 1.5, waited
    assert_refused(raw, 408, "RequestTimeoutError", "did not arrive within 1 s")


def test_trickled_body_is_408_too_the_deadline_is_for_the_whole_body(server):
    with connect(server) as sock:
        sock.sendall(request_head(content_length="1000"))
        t0, raw = time.monotonic(), b""
        sock.settimeout(0.2)
        while time.monotonic() - t0 < 5:  # a byte every 0.2 s: never idle for the whole timeout
            try:
                raw = sock.recv(65536)
                break
            except socket.timeout:
                try:
                    sock.sendall(b" ")
                except OSError:  # closed between our recv and this send
                    break
        raw += read_until_closed(sock, 5)
        waited = time.monotonic() - t0
    assert waited < BODY_TIMEOUT_S + 1.5, waited
    assert_refused(raw, 408, "RequestTimeoutError", "did not arrive within")


def test_hundreds_of_stalled_clients_are_all_closed_and_others_served(server):
    n = 200
    socks = [connect(server) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(request_head(content_length="50") + b"{")
        t0 = time.monotonic()
        # Served meanwhile: the stalled clients hold no worker.
        assert httpx.get(f"{server.url}/v1/models", headers=headers(), timeout=5).status_code == 200
        sel = selectors.DefaultSelector()
        received = {}
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            received[s] = b""
        open_ = set(socks)
        while open_ and time.monotonic() - t0 < BODY_TIMEOUT_S + 4:
            for key, _ in sel.select(timeout=0.5):
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if chunk:
                    received[key.fileobj] += chunk
                else:
                    sel.unregister(key.fileobj)
                    open_.discard(key.fileobj)
        assert not open_, f"{len(open_)} of {n} stalled connections still open after {time.monotonic() - t0:.1f} s"
        assert all(parse_response(raw)[0] == 408 for raw in received.values())
    finally:
        for s in socks:
            s.close()


# --- the JSON of the body ----------------------------------------------------------------------


def completion_json(**extra) -> str:
    return json.dumps({**COMPLETION, **extra}, ensure_ascii=False)


NESTED = "[" * 5000 + "]" * 5000
BAD_BODIES = [
    ("truncated", completion_json()[:-1].encode(), "not valid JSON: Expecting ',' delimiter at line 1 column"),
    ("latin-1", completion_json(prompt="café").encode("latin-1"), "not valid UTF-8: invalid continuation byte"),
    ("utf-16", completion_json().encode("utf-16-le"), "not valid JSON"),
    ("bom", b"\xef\xbb\xbf" + completion_json().encode(), "not valid JSON: Unexpected UTF-8 BOM"),
    ("duplicate", b'{"model": "tiny-chat", "prompt": "hi", "prompt": "ho"}', 'the key "prompt" twice'),
    ("nested duplicate", b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "a", "content": "b"}]}',
     'the key "content" twice'),
    ("NaN", completion_json(temperature=float("nan")).encode(), "NaN is not a JSON value"),
    ("Infinity", completion_json(temperature=float("inf")).encode(), "Infinity is not a JSON value"),
    ("deep", f'{{"model": "tiny-chat", "prompt": {NESTED}}}'.encode(), "nest too deeply"),
    ("long integer", completion_json()[:-1].encode() + b', "seed": 1' + b"0" * 5000 + b"}",
     "Exceeds the limit (4300 digits)"),
]


@pytest.mark.parametrize("name, body, match", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_json_is_400_naming_the_problem(server, name, body, match):
    path = "chat/completions" if "messages" in body.decode("utf-8", "replace") else "completions"
    r = httpx.post(f"{server.url}/v1/{path}", content=body, timeout=30,
                   headers={**headers(), "content-type": "application/json"})
    assert_error(r, 400, "BadRequestError", match)
    assert r.json()["error"]["param"] is None


def test_json_check_leaves_valid_bodies_to_the_request_models():
    assert json_body_problem(completion_json().encode()) is None
    # \uXXXX escapes of lone surrogates are valid JSON: the request models refuse them, naming the field.
    assert json_body_problem(b'{"prompt": "\\ud800"}') is None
    assert json_body_problem(b'{"a": {"b": 1}, "c": {"b": 2}}') is None  # same key in two objects
    # a duplicate key that is not valid Unicode is named escaped, so that the error body stays encodable
    problem = json_body_problem(b'{"\\ud800": 1, "\\ud800": 2}')
    assert problem == 'the request body has the key "\\ud800" twice in one object'


def test_server_still_serves_after_all_that(server):
    assert server.proc.poll() is None
    r = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=headers(), timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
