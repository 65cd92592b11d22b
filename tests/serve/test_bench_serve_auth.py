"""`moe bench serve` against a server that wants an API key: a clear error naming HTTP 401 and how
to pass the key (not a KeyError), and no httpx log line per request."""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from moe.entrypoints.cli import main


class _NeedsKey(BaseHTTPRequestHandler):
    """Answers every request as `moe serve --api-key K` answers one without K."""

    def do_GET(self):
        body = json.dumps({"error": {"message": "invalid API key", "type": "AuthenticationError", "param": None,
                                     "code": 401}, "object": "error"}).encode()
        self.send_response(401)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def url():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NeedsKey)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("key_args, says", [([], "needs an API key"), (["--api-key", "wrong"], "refused the API key")])
def test_a_missing_or_wrong_key_is_a_clear_error(url, key_args, says, monkeypatch, capsys, caplog):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    caplog.set_level(logging.INFO)
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "2", "--disable-tqdm", *key_args])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and "KeyError" not in err
    assert says in err and "HTTP 401" in err and "--api-key" in err and "OPENAI_API_KEY" in err
    assert not [r for r in caplog.records if r.name.startswith("httpx")]  # no "HTTP Request: ..." lines
