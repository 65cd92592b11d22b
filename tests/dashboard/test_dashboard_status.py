"""data.json's derived numbers and the recording's state: the per-expert imbalance of each window, and "stopped"
(the end line a closed recording ends with, a file that stopped growing, an engine that died under `moe serve`)."""
from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from moe.dashboard import add_dashboard_routes, build_dashboard_app
from moe.expert_load.recording import (ExpertLoadMeta, ExpertLoadWindow, RecordingWriter, read_recording,
                                       windows_to_dashboard_json)
from moe.expert_load.tracker import ExpertLoadAPI, ExpertLoadTracker, physical_slot_ranks
from tests.dashboard.synthetic import imbalance, make_meta, make_window


def _data(client: TestClient) -> dict:
    r = client.get("/dashboard/data.json")
    assert r.status_code == 200
    return r.json()


# --- the per-expert imbalance ---

def test_expert_imbalance_is_max_over_mean_per_layer_and_null_for_an_idle_layer():
    meta = ExpertLoadMeta(model="m", layers=[0, 1, 2, 3], num_experts=4, ep_size=2)
    counts = [[4, 0, 0, 0],  # all on one expert: E
              [1, 1, 1, 1],  # uniform: 1
              [0, 0, 0, 0],  # no tokens: no imbalance
              [3, 1, 2, 2]]  # max 3 / mean 2
    window = ExpertLoadWindow.build(0, 0, 8, 1.7e9, counts, np.array(counts).reshape(4, 2, 2).sum(axis=2))
    app = FastAPI()
    add_dashboard_routes(app, lambda since: windows_to_dashboard_json(meta, [window], since))  # `moe serve`'s path
    payload = _data(TestClient(app))
    assert payload["windows"][0]["expert_imbalance"] == [4.0, 1.0, None, 1.5]
    # Beside it, what balancedness says of the same window: layer 0 is as uneven over experts as it can be, but
    # only half as uneven over the two ranks.
    assert payload["windows"][0]["balancedness"][0] == 0.5
    assert payload["error"] is None and payload["stopped"] is None  # present even when get_payload leaves them out


def test_file_payload_has_the_imbalance_of_every_window(tmp_path):
    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(5)
    windows = [make_window(i, rng, tokens=40) for i in range(3)]
    with RecordingWriter(path, make_meta()) as writer:
        for w in windows:
            writer.write_window(w)
    payload = _data(TestClient(build_dashboard_app(str(path))))
    for got, want in zip(payload["windows"], windows):
        np.testing.assert_allclose(got["expert_imbalance"], imbalance(want.counts), rtol=1e-12)
        assert got["time"] == want.time  # the time axis: when each window closed


# --- "stopped" ---

def test_a_closed_recording_ends_with_its_end_line_and_shows_stopped(tmp_path):
    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(0)
    writer = RecordingWriter(path, make_meta())
    writer.write_window(make_window(0, rng, tokens=10))
    client = TestClient(build_dashboard_app(str(path)))
    assert _data(client)["stopped"] is None  # being written: live

    before = time.time()
    writer.close()
    writer.close()  # once only
    stopped = _data(client)["stopped"]
    assert stopped["why"] == "recording ended" and before <= stopped["time"] <= time.time()
    assert read_recording(path).ended == stopped["time"]
    assert path.read_text(encoding="utf-8").count('{"end":') == 1

    # A new recording to the same path: live again, from its own first window.
    writer = RecordingWriter(path, make_meta())
    writer.write_window(make_window(0, rng, tokens=10))
    payload = _data(client)
    assert payload["stopped"] is None and len(payload["windows"]) == 1
    writer.close()


def test_a_line_after_the_end_line_makes_it_live_again(tmp_path):
    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(0)
    with RecordingWriter(path, make_meta()) as writer:
        writer.write_window(make_window(0, rng, tokens=10))
    client = TestClient(build_dashboard_app(str(path)))
    assert _data(client)["stopped"]["why"] == "recording ended"
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"window": make_window(1, rng, tokens=10).to_json()}) + "\n")
    payload = _data(client)
    assert payload["stopped"] is None and [w["index"] for w in payload["windows"]] == [0, 1]


def test_a_file_that_stopped_growing_without_its_end_line_shows_stopped(tmp_path):
    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(0)
    writer = RecordingWriter(path, make_meta())  # never closed: its process died, say
    writer.write_window(make_window(0, rng, tokens=10))
    client = TestClient(build_dashboard_app(str(path), stale_after_s=60))
    assert _data(client)["stopped"] is None
    written = time.time() - 61
    os.utime(path, (written, written))
    stopped = _data(client)["stopped"]
    assert stopped["why"] == "no end line, and the file not written for over 60 s"
    assert stopped["time"] == pytest.approx(written)
    writer.write_window(make_window(1, rng, tokens=10))  # it grows after all: live
    assert _data(client)["stopped"] is None
    writer._f.close()  # without the end line


def test_stop_expert_load_recording_writes_the_end_line(tmp_path):
    """LLM.stop_expert_load_recording's path on the engine core: ExpertLoadAPI.stop_recording folds the last
    steps into a window and closes the tracker's writer."""
    meta = ExpertLoadMeta(model="m", layers=[1, 3], num_experts=4, ep_size=2)
    zeros = {"logical": np.zeros((2, 4), np.int64), "physical": np.zeros((2, 4), np.int64)}
    tracker = ExpertLoadTracker(meta, physical_slot_ranks(4, 2), zeros, step=0)
    later = {"logical": np.array([[5, 1, 1, 1], [2, 2, 2, 2]]), "physical": np.array([[5, 1, 1, 1], [2, 2, 2, 2]])}
    core = SimpleNamespace(expert_load=tracker, num_steps=0)
    core.fold_expert_load = lambda: tracker.fold(later, core.num_steps)
    api = ExpertLoadAPI(core)
    path = str(tmp_path / "load.jsonl")
    api.start_recording(path)
    core.num_steps = 3
    api.stop_recording()
    rec = read_recording(path)
    assert [w.counts.tolist() for w in rec.windows] == [later["logical"].tolist()]
    assert rec.ended is not None and rec.ended >= rec.windows[0].time
    payload = _data(TestClient(build_dashboard_app(path)))
    assert payload["stopped"]["why"] == "recording ended" and payload["windows"][0]["expert_imbalance"] == [2.5, 1.0]


def test_live_dashboard_of_moe_serve_says_stopped_once_the_engine_died():
    from moe.entrypoints.serve.async_llm import AsyncLLM

    meta = make_meta()
    engine = SimpleNamespace(expert_load_meta=meta, expert_load_windows=[make_window(0, np.random.default_rng(0))],
                             dead=None)
    app = FastAPI()
    add_dashboard_routes(app, lambda since: AsyncLLM.expert_load_payload(engine, since))
    client = TestClient(app)
    assert _data(client)["stopped"] is None  # running, idle or not: live
    engine.dead = "engine core 0 exited with code 1"
    payload = _data(client)
    assert payload["stopped"] == {"why": "engine core died (engine core 0 exited with code 1)", "time": None}
    assert len(payload["windows"]) == 1  # what it recorded stays on the page
