"""The dashboard against hostile or careless recordings: NaN / Infinity in data.json, lines nested too deep or
otherwise bad, a last line still being written, and one that never ends."""
from __future__ import annotations

import builtins
import json
import logging
import math
import shutil
import subprocess

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from moe.dashboard import add_dashboard_routes, build_dashboard_app
from moe.dashboard.server import STATIC_DIR
from moe.entrypoints.cli import main
from moe.expert_load import recording as recording_module
from moe.expert_load.recording import RecordingTail, read_recording, windows_to_dashboard_json
from tests.dashboard.synthetic import LAYERS, make_meta, make_window

DEEP = "[" * 100_000 + "]" * 100_000  # valid JSON that json.loads cannot descend into (RecursionError)


def _strict_json(text: str):
    """json.loads that refuses NaN / Infinity, as a browser's JSON.parse does."""
    def refuse(name):
        raise AssertionError(f"data.json holds {name}, which is not JSON")
    return json.loads(text, parse_constant=refuse)


def _window_line(index: int, seed: int = 0, **fields) -> str:
    body = dict(make_window(index, np.random.default_rng(seed), tokens=5).to_json(), **fields)
    return json.dumps({"window": body}) + "\n"  # json.dumps writes NaN / Infinity unless told not to


def _write(path, lines: list[str]) -> None:
    """The meta line, then `lines` (no end line: a recording still being written)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines([json.dumps({"meta": make_meta().to_json()}) + "\n", *lines])


def _append(path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def bytes_read(monkeypatch) -> list[int]:
    """The bytes the recording reader reads, one entry per read call."""
    counts: list[int] = []

    class Counting:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            counts.append(len(data))
            return data

        def seek(self, *args):
            return self._f.seek(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    def counting_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return Counting(f) if mode == "rb" else f  # the reader's opens, not a writer's

    monkeypatch.setattr(recording_module, "open", counting_open, raising=False)
    return counts


# --- 10. NaN / Infinity in data.json ---

NAN_BALANCE = [math.nan, math.inf, -math.inf, 0.5]


@pytest.fixture
def nan_recording(tmp_path):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0), _window_line(1, time=math.nan, balancedness=NAN_BALANCE),
                  _window_line(2, time=math.inf, balancedness=[math.nan] * len(LAYERS))])
    return path


def test_data_json_sends_nan_and_infinity_as_null(nan_recording, caplog):
    client = TestClient(build_dashboard_app(str(nan_recording)))
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            r = client.get("/dashboard/data.json")
            assert r.status_code == 200 and r.headers["content-type"] == "application/json"
            payload = _strict_json(r.text)
    w0, w1, w2 = payload["windows"]
    assert w1["time"] is None and w1["balancedness"] == [None, None, None, 0.5]
    assert w2["time"] is None and w2["balancedness"] == [None] * len(LAYERS)
    assert dict(w0, expert_imbalance=None) == dict(make_window(0, np.random.default_rng(0), tokens=5).to_json(),
                                                   expert_imbalance=None)  # finite values untouched
    assert w1["counts"] == make_window(1, np.random.default_rng(0), tokens=5).counts.tolist()
    assert payload["error"] is None and payload["last_index"] == 2
    assert sum("NaN or Infinity" in m for m in _warnings(caplog)) == 1  # said once, not on every poll


def test_data_json_from_memory_sends_nan_as_null():
    """`moe serve`'s path: the payload comes from the engine's windows, not a file."""
    meta = make_meta()
    w = make_window(0, np.random.default_rng(1), tokens=5)
    w.balancedness = np.array(NAN_BALANCE)
    app = FastAPI()
    add_dashboard_routes(app, lambda since: windows_to_dashboard_json(meta, [w], since))
    r = TestClient(app).get("/dashboard/data.json")
    assert r.status_code == 200 and _strict_json(r.text)["windows"][0]["balancedness"] == [None, None, None, 0.5]


# Runs app.js in node with just enough of a page (elements, Plotly, fetch) to poll once and render.
_NODE_HARNESS = r"""
const fs = require("fs");
const els = {};
const node = (id) => ({ id, dataset: {}, style: {}, textContent: "", className: "",
  replaceChildren() {}, prepend() {}, append() {}, appendChild() {}, classList: { toggle() {} } });
const el = (id) => els[id] || (els[id] = node(id));
global.document = { body: { dataset: { prefix: "/dashboard" } }, title: "", getElementById: el,
  querySelector: el, querySelectorAll: () => [], createElement: () => node("new") };
global.window = { location: { search: "" }, setTimeout: () => {} };
global.getComputedStyle = () => ({ fontFamily: "sans-serif" });
const plots = {};
global.Plotly = { react: (id, traces) => { plots[id] = traces.map((t) => [t.name, t.x, t.y]); }, purge() {} };
const payload = JSON.parse(fs.readFileSync(0, "utf8"));
global.fetch = async () => ({ ok: true, json: async () => payload });
new Function(fs.readFileSync(process.argv[1], "utf8"))();
setTimeout(() => {
  const s = window.dashboardState;
  console.log(JSON.stringify({ balanceMean: s.balanceMean, mean: s.meanBalancedness, lastError: s.lastError,
    meanText: els["mean-balancedness"].textContent, overTime: plots["over-time"], windows: s.windowsReceived,
    status: els.status.dataset.state }));
}, 100);
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_page_script_draws_null_as_a_gap(nan_recording):
    text = TestClient(build_dashboard_app(str(nan_recording))).get("/dashboard/data.json").text
    out = subprocess.run(["node", "-e", _NODE_HARNESS, STATIC_DIR + "/app.js"], input=text, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    got = json.loads(out)
    m0 = float(np.mean(_strict_json(text)["windows"][0]["balancedness"]))
    assert got["windows"] == 3 and got["lastError"] is None
    # Window 1: only its finite layer counts; window 2 has none: a gap (null), not NaN or 0.
    assert got["balanceMean"][0] == pytest.approx(m0) and got["balanceMean"][1:] == [0.5, None]
    assert got["mean"] == pytest.approx((m0 + 0.5) / 2) and got["meanText"] == f"{(m0 + 0.5) / 2:.3f}"
    balance = [t for t in got["overTime"] if t[0].startswith("layer")][1::2]  # each layer: imbalance, balancedness
    assert got["overTime"][1][0] == "rank balancedness" and got["overTime"][1][2] == got["balanceMean"]
    assert [t[2][1:] for t in balance] == [[None, None], [None, None], [None, None], [0.5, None]]
    # A window without a valid time has no place on the time axis: null there too (a gap).
    assert [x is None for x in got["overTime"][0][1]] == [False, True, True]
    assert got["status"] == "live"


# --- 12. Bad lines, unfinished lines ---

def test_a_line_nested_too_deep_is_skipped_with_one_warning(tmp_path, caplog, capsys, monkeypatch):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0), DEEP + "\n", _window_line(1)])
    with caplog.at_level(logging.WARNING):
        client = TestClient(build_dashboard_app(str(path)))
        payloads = [client.get("/dashboard/data.json").json() for _ in range(3)]
    assert _warnings(caplog) == [f"{path}, line 3: not a JSON line (nested too deep); line skipped"]
    assert [w["index"] for w in payloads[-1]["windows"]] == [0, 1]
    assert "line 3" in payloads[-1]["error"]  # the page says what it lacks
    # `moe dashboard` serves it (uvicorn stubbed out) instead of dying with a traceback.
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    assert main(["dashboard", str(path)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_read_recording_reports_a_deep_line_as_value_error(tmp_path):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0), DEEP + "\n", _window_line(1)])
    with pytest.raises(ValueError, match=r"load.jsonl, line 3: not a JSON line \(nested too deep\)"):
        read_recording(path)


def test_each_bad_line_is_reported_once_and_the_rest_read(tmp_path, caplog):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0)])
    tail = RecordingTail(path, strict=False)
    with caplog.at_level(logging.WARNING):
        tail.poll()
        bad = ["{oops\n", "\n", '{"window": {"index": ' + "9" * 5000 + "}}\n",  # over Python's int-digit limit
               _window_line(1).replace('"time": 1700000005.0', '"time": ' + "9" * 400),  # float() overflows
               _window_line(1, counts=json.loads("[" * 900 + "]" * 900))]  # within json's depth, beyond numpy's
        _append(path, "".join(bad))
        with open(path, "ab") as f:
            f.write(b'{"gossip": "\xff"}\n')  # not UTF-8
        _append(path, _window_line(2))
        assert tail.poll()
        for _ in range(3):
            assert not tail.poll()
    assert [w.index for w in tail.recording.windows] == [0, 2]
    lines = [int(m.split(", line ")[1].split(":")[0]) for m in _warnings(caplog)]
    assert lines == [3, 4, 5, 6, 7, 8] and tail.skipped == 6
    assert all(m.startswith(f"{path}, line ") and m.endswith("; line skipped") for m in _warnings(caplog))


def test_truncated_last_line_is_read_once_a_later_append_completes_it(tmp_path, caplog, bytes_read):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0)])
    client = TestClient(build_dashboard_app(str(path)))
    line = _window_line(1)
    cuts = [0, len(line) // 3, 2 * len(line) // 3, len(line)]
    with caplog.at_level(logging.WARNING):
        for a, b in zip(cuts, cuts[1:]):
            assert [w["index"] for w in client.get("/dashboard/data.json").json()["windows"]] == [0]
            _append(path, line[a:b])
        payload = client.get("/dashboard/data.json").json()
    assert [w["index"] for w in payload["windows"]] == [0, 1] and payload["error"] is None
    assert _warnings(caplog) == []
    assert sum(bytes_read) == path.stat().st_size  # every byte read once: each poll went on where the last stopped


def test_a_growing_unfinished_line_is_not_reread(tmp_path, bytes_read):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0)])
    tail = RecordingTail(path, strict=False)
    tail.poll()
    start = sum(bytes_read)
    piece = '"' + "x" * 99_999  # 100 kB a poll, never a newline
    for _ in range(20):
        _append(path, piece)
        tail.poll()
    assert sum(bytes_read) - start == 20 * len(piece)  # not 1 + 2 + ... + 20 pieces


def test_an_unfinished_line_past_the_bound_is_reported_once_and_skipped(tmp_path, caplog, bytes_read):
    path = tmp_path / "load.jsonl"
    _write(path, [_window_line(0)])
    tail = RecordingTail(path, strict=False, max_line_bytes=4096)
    with caplog.at_level(logging.WARNING):
        tail.poll()
        _append(path, "y" * 3000)
        tail.poll()
        assert _warnings(caplog) == []  # still within the bound: maybe a writer mid-line
        _append(path, "y" * 3000)
        tail.poll()
        assert _warnings(caplog) == [f"{path}, line 3: longer than 4096 bytes; line skipped"]
        for _ in range(3):  # it goes on growing: dropped as it comes, not reported again
            _append(path, "y" * 50_000)
            tail.poll()
        assert len(_warnings(caplog)) == 1
        assert tail._partial == b""  # nothing of it is held
        _append(path, "\n" + _window_line(1) + "{oops\n")
        assert tail.poll()
    assert [w.index for w in tail.recording.windows] == [0, 1]
    assert _warnings(caplog)[1].startswith(f"{path}, line 5: not a JSON line")  # line numbers kept counting
    assert sum(bytes_read) == path.stat().st_size


def test_a_bad_meta_line_still_stops_the_dashboard(tmp_path, capsys):
    path = tmp_path / "load.jsonl"
    path.write_text(DEEP + "\n", encoding="utf-8")
    assert main(["dashboard", str(path)]) == 1
    err = capsys.readouterr().err
    assert "load.jsonl, line 1: not a JSON line (nested too deep)" in err and "Traceback" not in err
