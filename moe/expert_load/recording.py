"""Expert-load recordings: how many tokens each expert of each MoE layer received, window by window.

The file is JSON lines (UTF-8, one object per line), flushed line by line so a reader can follow a
recording that is still being written:

    {"meta": {"format": "moe-expert-load", "version": 1, "model": ..., "layers": [...], "num_experts": E,
              "ep_size": P, "num_physical_experts": X, "window_steps": N}}
    {"window": {"index": i, "step_start": s, "step_end": e, "time": t, "counts": [[...]], "per_rank": [[...]],
                "balancedness": [...]}}
    {"placement": {"index_after": i, "phys_to_log": [[...]]}}      # EPLB moved experts after window i

Counts are per window, not cumulative; a token routed to top-k experts counts k times.

Shape legend: L = MoE layers recorded (rows), E = logical experts, P = expert-parallel ranks,
X = physical expert slots (E plus EPLB's redundant replicas).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

FORMAT = "moe-expert-load"
VERSION = 1


def balancedness_of(per_rank_LP: np.ndarray) -> np.ndarray:
    """mean / max of the rows each rank processed, per layer; 1.0 for a layer that saw no tokens."""
    per_rank_LP = np.asarray(per_rank_LP, dtype=np.float64)
    max_L = per_rank_LP.max(axis=1)
    mean_L = per_rank_LP.mean(axis=1)
    return np.where(max_L > 0, mean_L / np.where(max_L > 0, max_L, 1.0), 1.0)


def _int_matrix(value, name: str, shape: tuple[int, int]) -> np.ndarray:
    """A JSON list of lists of non-negative ints -> int64 [rows, cols], or a ValueError naming `name`."""
    try:
        arr = np.asarray(value)
    except ValueError as e:  # ragged rows
        raise ValueError(f"{name} is not a rectangular matrix: {e}") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got {arr.dtype}")
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {list(arr.shape)}, expected {list(shape)}")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        raise ValueError(f"{name} holds negative values")
    return arr


def _require(d: dict, key: str, kind, what: str):
    if key not in d:
        raise ValueError(f"{what} lacks the field {key!r}")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise ValueError(f"{what} field {key!r} must be {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


@dataclass
class ExpertLoadMeta:
    model: str
    layers: list[int]  # decoder-layer index of each recorded MoE layer (one row of counts each)
    num_experts: int
    ep_size: int = 1
    num_physical_experts: int | None = None  # None -> num_experts (no EPLB redundancy)
    window_steps: int = 1

    def __post_init__(self):
        if self.num_physical_experts is None:
            self.num_physical_experts = self.num_experts
        self.layers = [int(x) for x in self.layers]
        if not self.layers:
            raise ValueError("ExpertLoadMeta needs at least one MoE layer")
        for name in ("num_experts", "ep_size", "num_physical_experts", "window_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExpertLoadMeta.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_physical_experts < self.num_experts:
            raise ValueError(f"num_physical_experts ({self.num_physical_experts}) < num_experts "
                             f"({self.num_experts})")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "layers": list(self.layers),
                "num_experts": self.num_experts, "ep_size": self.ep_size,
                "num_physical_experts": self.num_physical_experts, "window_steps": self.window_steps}

    @classmethod
    def from_json(cls, d: dict) -> ExpertLoadMeta:
        if not isinstance(d, dict):
            raise ValueError(f"meta must be an object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise ValueError(f"not an expert-load recording: format is {d.get('format')!r}, expected {FORMAT!r}")
        if d.get("version") != VERSION:
            raise ValueError(f"unsupported expert-load recording version {d.get('version')!r} "
                             f"(this reader knows version {VERSION})")
        layers = _require(d, "layers", list, "meta")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
            raise ValueError(f"meta field 'layers' must be a list of integers, got {layers!r}")
        return cls(model=_require(d, "model", str, "meta"), layers=layers,
                   num_experts=_require(d, "num_experts", int, "meta"), ep_size=_require(d, "ep_size", int, "meta"),
                   num_physical_experts=_require(d, "num_physical_experts", int, "meta"),
                   window_steps=_require(d, "window_steps", int, "meta"))


@dataclass
class ExpertLoadWindow:
    index: int
    step_start: int  # engine steps [step_start, step_end) folded into this window
    step_end: int
    time: float  # unix seconds when the window was closed
    counts: np.ndarray  # int64 [L, E]: tokens routed to each logical expert in this window
    per_rank: np.ndarray  # int64 [L, P]: rows each EP rank processed in this window
    balancedness: np.ndarray  # float64 [L]: mean/max of per_rank (1.0 for an idle layer)

    @classmethod
    def build(cls, index: int, step_start: int, step_end: int, time: float, counts_LE, per_rank_LP
              ) -> ExpertLoadWindow:
        """A window with its balancedness computed from per_rank (what a recorder calls)."""
        counts_LE = np.asarray(counts_LE, dtype=np.int64)
        per_rank_LP = np.asarray(per_rank_LP, dtype=np.int64)
        return cls(index, step_start, step_end, float(time), counts_LE, per_rank_LP, balancedness_of(per_rank_LP))

    def to_json(self) -> dict:
        return {"index": int(self.index), "step_start": int(self.step_start), "step_end": int(self.step_end),
                "time": float(self.time), "counts": np.asarray(self.counts).tolist(),
                "per_rank": np.asarray(self.per_rank).tolist(),
                "balancedness": [float(b) for b in np.asarray(self.balancedness)]}

    @classmethod
    def from_json(cls, d: dict, meta: ExpertLoadMeta) -> ExpertLoadWindow:
        if not isinstance(d, dict):
            raise ValueError(f"window must be an object, got {type(d).__name__}")
        L = meta.num_layers
        index = _require(d, "index", int, "window")
        step_start = _require(d, "step_start", int, "window")
        step_end = _require(d, "step_end", int, "window")
        if step_end < step_start:
            raise ValueError(f"window {index}: step_end {step_end} < step_start {step_start}")
        time = float(_require(d, "time", (int, float), "window"))
        counts = _int_matrix(_require(d, "counts", list, "window"), f"window {index} counts",
                             (L, meta.num_experts))
        per_rank = _int_matrix(_require(d, "per_rank", list, "window"), f"window {index} per_rank",
                               (L, meta.ep_size))
        bal = _require(d, "balancedness", list, "window")
        if len(bal) != L or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bal):
            raise ValueError(f"window {index} balancedness must be {L} numbers, got {bal!r}")
        return cls(index, step_start, step_end, time, counts, per_rank, np.asarray(bal, dtype=np.float64))


@dataclass
class ExpertPlacement:
    index_after: int  # the placement holds from window index_after + 1 on
    phys_to_log: np.ndarray  # int64 [L, X]: the logical expert held by each physical slot

    def to_json(self) -> dict:
        return {"index_after": int(self.index_after), "phys_to_log": np.asarray(self.phys_to_log).tolist()}

    @classmethod
    def from_json(cls, d: dict, meta: ExpertLoadMeta) -> ExpertPlacement:
        if not isinstance(d, dict):
            raise ValueError(f"placement must be an object, got {type(d).__name__}")
        index_after = _require(d, "index_after", int, "placement")
        phys_to_log = _int_matrix(_require(d, "phys_to_log", list, "placement"), "placement phys_to_log",
                                  (meta.num_layers, meta.num_physical_experts))
        if (phys_to_log >= meta.num_experts).any():
            raise ValueError(f"placement phys_to_log names an expert >= num_experts ({meta.num_experts})")
        return cls(index_after, phys_to_log)


@dataclass
class Recording:
    meta: ExpertLoadMeta
    windows: list[ExpertLoadWindow] = field(default_factory=list)
    placements: list[ExpertPlacement] = field(default_factory=list)


def _line(kind: str, body: dict) -> str:
    return json.dumps({kind: body}, separators=(",", ":")) + "\n"


class RecordingWriter:
    """Writes a recording, one flushed line at a time (the meta line at once)."""

    def __init__(self, path: str | os.PathLike, meta: ExpertLoadMeta):
        self.path = os.fspath(path)
        self.meta = meta
        self._f = open(self.path, "w", encoding="utf-8")
        self._write(_line("meta", meta.to_json()))

    def _write(self, line: str) -> None:
        if self._f.closed:
            raise ValueError(f"recording {self.path!r} is closed")
        self._f.write(line)
        self._f.flush()

    def write_window(self, window: ExpertLoadWindow) -> None:
        m = self.meta
        shapes = {"counts": (m.num_layers, m.num_experts), "per_rank": (m.num_layers, m.ep_size),
                  "balancedness": (m.num_layers,)}
        for name, shape in shapes.items():
            got = np.shape(getattr(window, name))
            if got != shape:
                raise ValueError(f"window {window.index} {name} has shape {list(got)}, expected {list(shape)}")
        self._write(_line("window", window.to_json()))

    def write_placement(self, index_after: int, phys_to_log_LX) -> None:
        phys_to_log_LX = np.asarray(phys_to_log_LX, dtype=np.int64)
        expected = (self.meta.num_layers, self.meta.num_physical_experts)
        if phys_to_log_LX.shape != expected:
            raise ValueError(f"phys_to_log has shape {list(phys_to_log_LX.shape)}, expected {list(expected)}")
        self._write(_line("placement", ExpertPlacement(index_after, phys_to_log_LX).to_json()))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RecordingTail:
    """Reads a recording incrementally: each poll() parses the complete lines added since the last one.

    A last line without its newline is a writer mid-write: it is left for the next poll (read_recording
    takes it only when it already parses as complete JSON). A file that shrank was rewritten: start over.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.recording: Recording | None = None
        self._offset = 0  # bytes consumed (always at a line start)
        self._line_no = 0  # lines consumed

    def poll(self, final: bool = False) -> bool:
        """Reads what was appended; True when something new was parsed. Raises ValueError on a bad line."""
        size = os.path.getsize(self.path)
        if size < self._offset:
            self.recording, self._offset, self._line_no = None, 0, 0
        if size == self._offset:
            return False
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when data ends with a newline
        changed = False
        for raw in lines:
            self._parse(raw, self._line_no + 1)
            self._line_no += 1
            self._offset += len(raw) + 1
            changed = True
        if tail and final:
            try:
                json.loads(tail.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                return changed  # truncated by a writer still writing: ignored
            self._parse(tail, self._line_no + 1)
            self._line_no += 1
            self._offset += len(tail)
            changed = True
        return changed

    def _parse(self, raw: bytes, line_no: int) -> None:
        where = f"{self.path}, line {line_no}"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: not a JSON line ({e})") from None
        if not isinstance(obj, dict) or len(obj) != 1:
            raise ValueError(f"{where}: expected one object with a single key (meta, window or placement)")
        (kind, body), = obj.items()
        try:
            if self.recording is None:
                if kind != "meta":
                    raise ValueError(f"the first line must be the meta line, got {kind!r}")
                self.recording = Recording(ExpertLoadMeta.from_json(body))
            elif kind == "window":
                w = ExpertLoadWindow.from_json(body, self.recording.meta)
                prev = self.recording.windows[-1].index if self.recording.windows else -1
                if w.index <= prev:
                    raise ValueError(f"window index {w.index} does not follow {prev}")
                self.recording.windows.append(w)
            elif kind == "placement":
                self.recording.placements.append(ExpertPlacement.from_json(body, self.recording.meta))
            else:
                raise ValueError(f"unknown line kind {kind!r} (expected meta, window or placement)")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def read_recording(path: str | os.PathLike) -> Recording:
    """The whole recording; FileNotFoundError when missing, ValueError naming file and line when malformed."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"recording {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"recording {path!r} is not a file")
    tail = RecordingTail(path)
    tail.poll(final=True)
    if tail.recording is None:
        raise ValueError(f"{path}: not an expert-load recording (no meta line)")
    return tail.recording


def windows_to_dashboard_json(meta: ExpertLoadMeta, windows: list[ExpertLoadWindow], since: int = 0,
                              rebalances: int = 0) -> dict:
    """The dashboard's payload: the meta, the windows with index >= since, the count of rebalances, and
    last_index (the newest window's index, -1 for none: a page that has seen more was fed a rewritten file)."""
    return {"meta": meta.to_json(), "windows": [w.to_json() for w in windows if w.index >= since],
            "rebalances": int(rebalances), "last_index": int(windows[-1].index) if windows else -1}


def recording_to_dashboard_json(recording: Recording, since: int = 0) -> dict:
    return windows_to_dashboard_json(recording.meta, recording.windows, since, len(recording.placements))
