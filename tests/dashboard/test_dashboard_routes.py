"""The dashboard's HTTP routes (FastAPI TestClient) and the `moe dashboard` command's errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from moe.dashboard import add_dashboard_routes, build_dashboard_app
from moe.dashboard.server import plotly_js_path
from moe.entrypoints.cli import main
from moe.expert_load.recording import RecordingWriter, windows_to_dashboard_json
from tests.dashboard.synthetic import make_meta, make_window


@pytest.fixture
def recording(tmp_path):
    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(0)
    writer = RecordingWriter(path, make_meta())
    for i in range(3):
        writer.write_window(make_window(i, rng, tokens=20))
    yield path, writer, rng
    writer.close()


def test_page_and_static_files_are_served(recording):
    client = TestClient(build_dashboard_app(str(recording[0])))
    for url in ("/dashboard", "/dashboard/"):
        r = client.get(url)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        # Absolute links under the prefix: the page works with or without the trailing slash.
        assert 'src="/dashboard/static/plotly.min.js"' in r.text and 'src="/dashboard/static/app.js"' in r.text
        assert "{{PREFIX}}" not in r.text and "http" not in r.text.replace("http-equiv", "")  # nothing external
    r = client.get("/dashboard/static/plotly.min.js")
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    with open(plotly_js_path(), "rb") as f:
        assert r.content == f.read()
    assert "dashboardState" in client.get("/dashboard/static/app.js").text
    assert client.get("/dashboard/static/style.css").headers["content-type"].startswith("text/css")
    assert client.get("/", follow_redirects=False).headers["location"] == "/dashboard/"


@pytest.mark.parametrize("name", ["../server.py", "..%2Fserver.py", "%2e%2e/%2e%2e/expert_load_file.py",
                                  "static/app.js", "/etc/passwd", "index.html", "nope.js"])
def test_static_route_serves_only_its_files(recording, name):
    client = TestClient(build_dashboard_app(str(recording[0])))
    r = client.get("/dashboard/static/" + name)
    assert r.status_code == 404
    assert b"import" not in r.content  # no Python source leaked


def test_data_json_since_and_live_growth(recording):
    path, writer, rng = recording
    client = TestClient(build_dashboard_app(str(path)))
    payload = client.get("/dashboard/data.json").json()
    assert payload["meta"]["model"] == "synthetic/skewed-moe" and payload["error"] is None
    assert [w["index"] for w in payload["windows"]] == [0, 1, 2] and payload["last_index"] == 2
    assert [w["index"] for w in client.get("/dashboard/data.json?since=2").json()["windows"]] == [2]
    assert client.get("/dashboard/data.json?since=3").json()["windows"] == []
    assert client.get("/dashboard/data.json?since=-1").status_code == 422
    # The file grows: the next poll sees it.
    new = make_window(3, rng, tokens=20)
    writer.write_window(new)
    writer.write_placement(3, np.tile(np.arange(16), (4, 1)))
    payload = client.get("/dashboard/data.json?since=3").json()
    assert [w["index"] for w in payload["windows"]] == [3] and payload["rebalances"] == 1
    assert payload["windows"][0]["counts"] == new.counts.tolist()


def test_a_bad_line_appended_later_is_reported_not_fatal(recording):
    path, writer, _ = recording
    client = TestClient(build_dashboard_app(str(path)))
    with open(path, "a", encoding="utf-8") as f:
        f.write("{oops\n")
    payload = client.get("/dashboard/data.json").json()
    assert "line 5" in payload["error"] and len(payload["windows"]) == 3


def test_add_dashboard_routes_on_another_app():
    """What `moe serve` does: the payload comes from memory, under a prefix of its own."""
    meta = make_meta()
    windows = [make_window(i, np.random.default_rng(i), tokens=10) for i in range(2)]
    asked = []

    def get_payload(since: int) -> dict:
        asked.append(since)
        return windows_to_dashboard_json(meta, windows, since, rebalances=5)

    app = FastAPI()
    add_dashboard_routes(app, get_payload, prefix="/moe/load/")
    client = TestClient(app)
    assert 'src="/moe/load/static/app.js"' in client.get("/moe/load").text
    payload = client.get("/moe/load/data.json?since=1").json()
    assert asked == [1] and payload["rebalances"] == 5 and [w["index"] for w in payload["windows"]] == [1]
    assert client.get("/moe/load/static/plotly.min.js").status_code == 200
    with pytest.raises(ValueError, match="prefix"):
        add_dashboard_routes(FastAPI(), get_payload, prefix="/")


def test_cli_reports_a_missing_or_bad_recording(tmp_path, capsys):
    assert main(["dashboard", str(tmp_path / "missing.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "moe dashboard: error:" in err and "missing.jsonl" in err and "does not exist" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"meta": {"format": "other"}}) + "\n", encoding="utf-8")
    assert main(["dashboard", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl, line 1: not an expert-load recording" in err and "Traceback" not in err


def test_cli_serves_with_uvicorn_on_loopback_by_default(recording, monkeypatch, capsys):
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append((app, kw)))
    assert main(["dashboard", str(recording[0]), "--port", "9123"]) == 0
    (app, kw), = calls
    assert kw["host"] == "127.0.0.1" and kw["port"] == 9123
    assert "http://127.0.0.1:9123/dashboard/" in capsys.readouterr().out
    assert TestClient(app).get("/dashboard/data.json").json()["last_index"] == 2
