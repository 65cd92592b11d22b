"""The expert-load recording format: round trip, a writer mid-line, malformed lines, the dashboard payload."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moe.expert_load.recording import (
    ExpertLoadMeta,
    ExpertLoadWindow,
    RecordingTail,
    RecordingWriter,
    balancedness_of,
    read_recording,
    recording_to_dashboard_json,
    windows_to_dashboard_json,
)
from tests.dashboard.synthetic import EP_SIZE, LAYERS, NUM_EXPERTS, make_meta, make_window


def _write(path, n_windows=3, seed=0):
    rng = np.random.default_rng(seed)
    windows = [make_window(i, rng) for i in range(n_windows)]
    with RecordingWriter(path, make_meta()) as w:
        for win in windows:
            w.write_window(win)
    return windows


def test_round_trip(tmp_path):
    path = tmp_path / "load.jsonl"
    rng = np.random.default_rng(1)
    windows = [make_window(i, rng) for i in range(4)]
    phys_to_log = rng.permutation(NUM_EXPERTS)[None].repeat(len(LAYERS), axis=0)
    with RecordingWriter(path, make_meta()) as w:
        for win in windows[:2]:
            w.write_window(win)
        w.write_placement(1, phys_to_log)
        for win in windows[2:]:
            w.write_window(win)
    rec = read_recording(path)
    assert rec.meta == make_meta()
    assert [w.index for w in rec.windows] == [0, 1, 2, 3]
    for got, want in zip(rec.windows, windows):
        assert (got.step_start, got.step_end, got.time) == (want.step_start, want.step_end, want.time)
        assert got.counts.dtype == np.int64 and got.per_rank.dtype == np.int64
        assert got.balancedness.dtype == np.float64
        np.testing.assert_array_equal(got.counts, want.counts)
        np.testing.assert_array_equal(got.per_rank, want.per_rank)
        np.testing.assert_array_equal(got.balancedness, want.balancedness)
    assert len(rec.placements) == 1 and rec.placements[0].index_after == 1
    np.testing.assert_array_equal(rec.placements[0].phys_to_log, phys_to_log)
    # Each line is one JSON object, the meta first, carrying the format and version; closing wrote the end line.
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 7 and json.loads(lines[0])["meta"]["format"] == "moe-expert-load"
    assert json.loads(lines[0])["meta"]["version"] == 1 and "placement" in json.loads(lines[3])
    assert list(json.loads(lines[-1])) == ["end"] and rec.ended == json.loads(lines[-1])["end"]["time"]


def test_balancedness_is_mean_over_max_and_one_for_idle_layers():
    per_rank_LP = np.array([[30, 10], [0, 0], [5, 5]])
    np.testing.assert_allclose(balancedness_of(per_rank_LP), [20 / 30, 1.0, 1.0])
    w = ExpertLoadWindow.build(0, 0, 4, 0.0, np.ones((3, 4), dtype=np.int64), per_rank_LP)
    np.testing.assert_allclose(w.balancedness, [20 / 30, 1.0, 1.0])


def test_writer_flushes_each_line_for_a_live_reader(tmp_path):
    path = tmp_path / "live.jsonl"
    rng = np.random.default_rng(2)
    with RecordingWriter(path, make_meta()) as w:
        assert read_recording(path).windows == []
        w.write_window(make_window(0, rng))
        assert [x.index for x in read_recording(path).windows] == [0]


def test_truncated_last_line_is_ignored(tmp_path):
    path = tmp_path / "load.jsonl"
    _write(path, n_windows=2)
    full_line = json.dumps({"window": make_window(2, np.random.default_rng(3)).to_json()})
    with open(path, "a", encoding="utf-8") as f:
        f.write(full_line[: len(full_line) // 2])  # a writer caught mid-line
    assert [w.index for w in read_recording(path).windows] == [0, 1]
    # The incremental reader waits for the rest, then takes the line.
    tail = RecordingTail(path)
    tail.poll()
    assert len(tail.recording.windows) == 2
    with open(path, "a", encoding="utf-8") as f:
        f.write(full_line[len(full_line) // 2:] + "\n")
    assert tail.poll() and [w.index for w in tail.recording.windows] == [0, 1, 2]
    assert not tail.poll()  # nothing new


def test_complete_last_line_without_newline_is_read(tmp_path):
    path = tmp_path / "load.jsonl"
    _write(path, n_windows=1)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"window": make_window(1, np.random.default_rng(4)).to_json()}))
    assert [w.index for w in read_recording(path).windows] == [0, 1]


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "not a JSON line"),
    ('{"window": {"index": 3}}', "lacks the field 'step_start'"),
    ('{"gossip": {}}', "unknown line kind 'gossip'"),
    ('[1, 2]', "expected one object"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "load.jsonl"
    _write(path, n_windows=2)
    lines = path.read_text(encoding="utf-8").splitlines()
    lines.insert(2, bad_line)  # line 3, followed by a good line (so it is not a truncated tail)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"load.jsonl, line 3: .*{message}"):
        read_recording(path)


def test_window_of_the_wrong_shape_or_type_is_refused(tmp_path):
    path = tmp_path / "load.jsonl"
    _write(path, n_windows=1)
    win = make_window(1, np.random.default_rng(5)).to_json()
    for field, value, message in [("counts", win["counts"][:-1], r"counts has shape \[3, 16\], expected \[4, 16\]"),
                                  ("per_rank", [[1.5, 2.0]] * len(LAYERS), "per_rank must hold integers"),
                                  ("index", 0, "window index 0 does not follow 0")]:
        bad = dict(win, **{field: value})
        text = path.read_text(encoding="utf-8").splitlines()[:2]
        path.write_text("\n".join(text + [json.dumps({"window": bad})]) + "\n", encoding="utf-8")
        with pytest.raises(ValueError, match=f"line 3: .*{message}"):
            read_recording(path)


def test_wrong_format_or_version_is_refused(tmp_path):
    path = tmp_path / "load.jsonl"
    meta = make_meta().to_json()
    path.write_text(json.dumps({"meta": dict(meta, version=2)}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="load.jsonl, line 1: unsupported expert-load recording version 2"):
        read_recording(path)
    path.write_text(json.dumps({"meta": dict(meta, format="something-else")}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1: not an expert-load recording"):
        read_recording(path)
    path.write_text(json.dumps({"window": {}}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 1: the first line must be the meta line"):
        read_recording(path)
    path.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="no meta line"):
        read_recording(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_recording(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="is not a file"):
        read_recording(tmp_path)


def test_meta_validation():
    with pytest.raises(ValueError, match="at least one MoE layer"):
        ExpertLoadMeta(model="m", layers=[], num_experts=8)
    with pytest.raises(ValueError, match="num_physical_experts"):
        ExpertLoadMeta(model="m", layers=[0], num_experts=8, num_physical_experts=6)
    assert ExpertLoadMeta(model="m", layers=[0], num_experts=8).num_physical_experts == 8


def test_writer_refuses_a_window_of_the_wrong_shape(tmp_path):
    with RecordingWriter(tmp_path / "load.jsonl", make_meta()) as w:
        bad = ExpertLoadWindow.build(0, 0, 8, 0.0, np.zeros((len(LAYERS), NUM_EXPERTS + 1), dtype=np.int64),
                                     np.zeros((len(LAYERS), EP_SIZE), dtype=np.int64))
        with pytest.raises(ValueError, match=r"counts has shape \[4, 17\], expected \[4, 16\]"):
            w.write_window(bad)
        with pytest.raises(ValueError, match="phys_to_log has shape"):
            w.write_placement(0, np.zeros((len(LAYERS), 3)))


def test_dashboard_payload_since(tmp_path):
    path = tmp_path / "load.jsonl"
    windows = _write(path, n_windows=4)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"placement": {"index_after": 3, "phys_to_log": [list(range(16))] * 4}}) + "\n")
    rec = read_recording(path)
    payload = recording_to_dashboard_json(rec, since=2)
    assert payload["meta"] == make_meta().to_json()
    assert [w["index"] for w in payload["windows"]] == [2, 3]
    assert payload["windows"][0]["counts"] == windows[2].counts.tolist()
    assert payload["rebalances"] == 1 and payload["last_index"] == 3
    assert json.loads(json.dumps(payload)) == payload  # plain JSON types only
    assert recording_to_dashboard_json(rec)["windows"][0]["index"] == 0
    empty = windows_to_dashboard_json(rec.meta, [], since=0)
    assert empty["windows"] == [] and empty["last_index"] == -1 and empty["rebalances"] == 0
