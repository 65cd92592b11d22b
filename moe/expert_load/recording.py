"""Expert-load recordings: how many tokens each expert of each MoE layer received, window by window.

The file is JSON lines (UTF-8, one object per line), flushed line by line so a reader can follow a
recording that is still being written:

    {"meta": {"format": "moe-expert-load", "version": 1, "model": ..., "layers": [...], "num_experts": E,
              "ep_size": P, "num_physical_experts": X, "window_steps": N}}
    {"window": {"index": i, "step_start": s, "step_end": e, "time": t, "counts": [[...]], "per_rank": [[...]],
                "balancedness": [...]}}
    {"placement": {"index_after": i, "phys_to_log": [[...]]}}      # EPLB moved experts after window i
    {"end": {"time": t}}                                            # the recording was stopped (last line)

Counts are per window, not cumulative; a token routed to top-k experts counts k times. The end line is written
when the writer is closed (LLM.stop_expert_load_recording); a file without it was cut short or is still growing.

Shape legend: L = MoE layers recorded (rows), E = logical experts, P = expert-parallel ranks,
X = physical expert slots (E plus EPLB's redundant replicas).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np

logger = logging.getLogger(__name__)

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
    ended: float | None = None  # unix time of the end line, when it is the last line read


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
        """Ends the recording with its end line (a reader then knows nothing more will come)."""
        if not self._f.closed:
            self._write(_line("end", {"time": time.time()}))
            self._f.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The longest line a reader buffers: far above a real line (a window of 100 layers x 1024 experts is ~1 MiB),
# low enough that a line that never ends cannot eat the reader's memory.
MAX_LINE_BYTES = 64 << 20
_CHUNK_BYTES = 1 << 20  # read in pieces, so a big file is never held twice in memory


class RecordingTail:
    """Reads a recording incrementally: each poll() reads only the bytes appended since the last one.

    A last line without its newline is a writer mid-write: its bytes are kept and the next poll goes on from
    where this one stopped (read_recording takes such a line only when it already parses as complete JSON).
    A line longer than max_line_bytes is never buffered whole: it is reported once and skipped.
    A file that shrank was rewritten: start over.

    strict=True (read_recording): a bad line raises ValueError naming the file and line. strict=False (the
    dashboard, following a live file): a bad line after the meta line is logged once and skipped, and
    `skipped` / `last_problem` tell what was left out. A bad meta line raises in both modes: nothing can be
    read without it. After a raise, poll() raises the same error without reading until the file shrinks.
    """

    def __init__(self, path: str | os.PathLike, strict: bool = True, max_line_bytes: int = MAX_LINE_BYTES):
        self.path = os.fspath(path)
        self.strict = strict
        self.max_line_bytes = max_line_bytes
        self._reset()

    def _reset(self) -> None:
        self.recording: Recording | None = None
        self.skipped = 0  # lines left out (strict=False)
        self.last_problem: str | None = None  # why the latest of them was left out
        self._offset = 0  # bytes read (anywhere in a line)
        self._line_no = 0  # lines finished
        self._partial = bytearray()  # the unfinished line's bytes read so far
        self._overlong = False  # the unfinished line passed max_line_bytes (reported): drop it to its newline
        self._error: str | None = None  # what the last poll raised: raised again until the file shrinks

    def poll(self, final: bool = False) -> bool:
        """Reads what was appended; True when something new was parsed. `final`: the file is complete, so a
        last line without its newline is taken when it parses as JSON (a writer's cut-off line is ignored)."""
        size = os.path.getsize(self.path)
        if size < self._offset:
            self._reset()
        if self._error is not None:
            raise ValueError(self._error)  # a fresh one: re-raising one object would grow its traceback
        changed = False
        try:
            if size > self._offset:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    while self._offset < size:
                        chunk = f.read(min(_CHUNK_BYTES, size - self._offset))
                        if not chunk:  # truncated while we read: the next poll sees it shrank
                            break
                        self._offset += len(chunk)
                        changed |= self._feed(chunk)
            if final and self._partial and not self._overlong:
                raw = bytes(self._partial)
                try:
                    json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    return changed  # cut off by a writer still writing: ignored
                except (ValueError, RecursionError):
                    pass  # complete but bad: _line reports it
                self._partial.clear()
                changed |= self._line(raw)
        except ValueError as e:
            self._error = str(e)
            raise
        return changed

    def _feed(self, chunk: bytes) -> bool:
        changed, pos = False, 0
        while True:
            nl = chunk.find(b"\n", pos)
            piece = chunk[pos:] if nl < 0 else chunk[pos:nl]
            if not self._overlong and len(self._partial) + len(piece) > self.max_line_bytes:
                self._overlong = True
                self._partial.clear()
                self._problem(self._line_no + 1, f"longer than {self.max_line_bytes} bytes")
            if nl < 0:
                if not self._overlong:
                    self._partial += piece
                return changed
            if self._overlong:  # its end: skipped, and already reported
                self._overlong = False
                self._line_no += 1
            else:
                raw = bytes(self._partial) + piece if self._partial else piece
                self._partial.clear()
                changed |= self._line(raw)
            pos = nl + 1

    def _line(self, raw: bytes) -> bool:
        """Parses one whole line (without its newline); True when it was taken."""
        self._line_no += 1
        try:
            self._parse(raw)
            return True
        except _BadLine as e:
            self._problem(self._line_no, str(e))
            return False

    def _problem(self, line_no: int, why: str) -> None:
        where = f"{self.path}, line {line_no}"
        if self.strict or self.recording is None:
            raise ValueError(f"{where}: {why}")
        self.skipped += 1
        self.last_problem = f"{where}: {why}; line skipped"
        logger.warning("%s", self.last_problem)

    def _parse(self, raw: bytes) -> None:
        try:
            obj = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise _BadLine("not a JSON line (nested too deep)") from None
        except (UnicodeDecodeError, ValueError) as e:  # ValueError: also an int of over 4300 digits
            raise _BadLine(f"not a JSON line ({e})") from None
        if not isinstance(obj, dict) or len(obj) != 1:
            raise _BadLine("expected one object with a single key (meta, window, placement or end)")
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
                self.recording.ended = None  # written after an end line: the file goes on
            elif kind == "placement":
                self.recording.placements.append(ExpertPlacement.from_json(body, self.recording.meta))
                self.recording.ended = None
            elif kind == "end":
                if not isinstance(body, dict):
                    raise ValueError(f"end must be an object, got {type(body).__name__}")
                self.recording.ended = float(_require(body, "time", (int, float), "end"))
            else:
                raise ValueError(f"unknown line kind {kind!r} (expected meta, window, placement or end)")
        # TypeError / OverflowError / RecursionError: odd values the checks above let through (float(10**400),
        # numpy on deep lists): still a bad line, not a crash.
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            raise _BadLine(str(e) or type(e).__name__) from None


class _BadLine(Exception):
    """A line that is not a valid recording line (the message says why, without file and line)."""


def check_recording_path(path: str | os.PathLike) -> str:
    """The path as a str; FileNotFoundError when missing, ValueError when not a regular file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"recording {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"recording {path!r} is not a file")
    return path


def read_recording(path: str | os.PathLike) -> Recording:
    """The whole recording; FileNotFoundError when missing, ValueError naming file and line when malformed."""
    path = check_recording_path(path)
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
