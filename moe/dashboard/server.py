"""HTTP routes of the expert-load dashboard, and an app that serves a saved (or growing) recording.

Routes under a prefix (default /dashboard):
    GET {prefix} and {prefix}/       the page
    GET {prefix}/data.json?since=K   get_payload(K): the meta, windows with index >= K, rebalances; each window
                                     gains expert_imbalance, and the payload error and stopped (null unless set)
    GET {prefix}/static/NAME         app.js, style.css, plotly.min.js (a fixed list: no paths)
"""
from __future__ import annotations

import html
import json
import logging
import math
import os
import threading
import time
from typing import Callable

from fastapi import FastAPI, HTTPException, Query
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from moe.expert_load.recording import RecordingTail, check_recording_path, recording_to_dashboard_json

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


def plotly_js_path() -> str:
    """plotly.min.js as the installed plotly package ships it (no CDN: the page works offline)."""
    import plotly

    path = os.path.join(os.path.dirname(plotly.__file__), "package_data", "plotly.min.js")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"plotly.min.js not found at {path!r}: reinstall the plotly package")
    return path


# The only files the static route serves: name -> (path getter, media type).
_STATIC_FILES: dict[str, tuple[Callable[[], str], str]] = {
    "app.js": (lambda: os.path.join(STATIC_DIR, "app.js"), "text/javascript"),
    "style.css": (lambda: os.path.join(STATIC_DIR, "style.css"), "text/css"),
    "plotly.min.js": (plotly_js_path, "text/javascript"),
}


def _finite(value):
    """`value` with every NaN / +-Infinity float replaced by None, recursively through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_bytes(payload: dict) -> tuple[bytes, bool]:
    """Strict JSON of the payload, and whether non-finite numbers had to become null. JSON has no NaN or
    Infinity (a browser's JSON.parse refuses Python's NaN), and a recording may hold them (time, balancedness)."""
    try:
        return json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8"), False
    except ValueError:  # only then pay for the walk
        return json.dumps(_finite(payload), allow_nan=False, separators=(",", ":")).encode("utf-8"), True


def expert_imbalance(counts_LE: list[list[int]]) -> list[float | None]:
    """Per layer: max / mean of the tokens its experts received (1 = uniform, E = all on one expert); None for
    a layer that received none. Unlike the per-rank balancedness it tells something on one rank too."""
    return [max(row) * len(row) / total if (total := sum(row)) > 0 else None for row in counts_LE]


def _with_derived(payload: dict) -> dict:
    """The payload as the page reads it: every window with its expert imbalance, and the keys the page
    expects present (a get_payload that has no error or stop to report leaves them out)."""
    windows = [dict(w, expert_imbalance=expert_imbalance(w["counts"])) for w in payload.get("windows", [])]
    return {"error": None, "stopped": None, **payload, "windows": windows}


def _page(prefix: str) -> str:
    with open(os.path.join(STATIC_DIR, "index.html"), encoding="utf-8") as f:
        return f.read().replace("{{PREFIX}}", html.escape(prefix, quote=True))


def add_dashboard_routes(app: FastAPI, get_payload: Callable[[int], dict], prefix: str = "/dashboard") -> None:
    """Mounts the dashboard on `app`; get_payload(since) returns the data.json dict (see
    moe.expert_load.recording.windows_to_dashboard_json), with "stopped": {"why": str, "time": unix s or None}
    once no window will come again (the page then says "stopped", not "live"). It is called from a worker
    thread."""
    prefix = "/" + prefix.strip("/")
    if prefix == "/":
        raise ValueError("the dashboard prefix must not be empty, e.g. '/dashboard'")

    def page() -> HTMLResponse:
        return HTMLResponse(_page(prefix), headers={"Cache-Control": "no-cache"})

    app.add_api_route(prefix, page, methods=["GET"], include_in_schema=False)
    app.add_api_route(prefix + "/", page, methods=["GET"], include_in_schema=False)

    warned = []

    # A plain def: FastAPI runs it in its thread pool, so a payload that reads a file does not block the loop.
    def data(since: int = Query(0, ge=0)) -> Response:
        body, nulled = _json_bytes(_with_derived(get_payload(since)))
        if nulled and not warned:
            warned.append(True)
            logger.warning("dashboard: the expert-load data holds NaN or Infinity; sent as null (shown as gaps)")
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    app.add_api_route(prefix + "/data.json", data, methods=["GET"], include_in_schema=False)

    def static(name: str) -> FileResponse:
        entry = _STATIC_FILES.get(name)
        if entry is None:
            raise HTTPException(status_code=404, detail=f"no static file {name!r}")
        path_of, media_type = entry
        return FileResponse(path_of(), media_type=media_type, headers={"Cache-Control": "max-age=3600"})

    # {name:path} so that any slash-bearing name reaches the lookup above and is refused there.
    app.add_api_route(prefix + "/static/{name:path}", static, methods=["GET"], include_in_schema=False)


# A file without its end line that has not been written for this long is taken as stopped (its writer died,
# or is idle): the page says so rather than "live". It turns live again if the file grows.
STALE_AFTER_S = 60.0


def build_dashboard_app(recording_path: str, stale_after_s: float = STALE_AFTER_S) -> FastAPI:
    """An app serving the dashboard of a recording file, followed as it grows (a live recording): each poll
    reads only the bytes appended since the last. A bad line is logged once, naming file and line, and
    skipped (the page shows it too); a last line without its newline waits for the rest.
    The recording is stopped once its end line is the last line, or when the file has not been written
    for `stale_after_s` seconds.
    Raises FileNotFoundError / ValueError at once when the file is missing or its meta line is missing or bad."""
    recording_path = check_recording_path(recording_path)
    tail = RecordingTail(recording_path, strict=False)
    tail.poll()  # a bad meta line raises here, with the file and line, rather than on the first poll
    if tail.recording is None:
        raise ValueError(f"{recording_path}: not an expert-load recording (no complete meta line)")
    lock = threading.Lock()
    state = {"error": None}

    def get_payload(since: int) -> dict:
        with lock:
            try:
                tail.poll()
                state["error"] = None
            except (OSError, ValueError) as e:
                # Keep serving what was read; the page shows the problem.
                if state["error"] != str(e):
                    logger.warning("dashboard: %s", e)
                state["error"] = str(e)
            error = state["error"]
            if error is None and tail.skipped:  # kept on the page: what it shows lacks these lines
                error = tail.last_problem if tail.skipped == 1 else \
                    f"{tail.skipped} lines skipped, the last: {tail.last_problem}"
            if tail.recording is None:  # the file was rewritten and its meta line is not there yet
                return {"meta": None, "windows": [], "rebalances": 0, "last_index": -1, "error": error}
            payload = recording_to_dashboard_json(tail.recording, since)
            ended = tail.recording.ended
        payload["error"] = error
        payload["stopped"] = _file_stopped(recording_path, ended, stale_after_s)
        return payload

    app = FastAPI(title="moe expert-load dashboard")
    add_dashboard_routes(app, get_payload)

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/dashboard/")

    return app


def _file_stopped(path: str, ended: float | None, stale_after_s: float) -> dict | None:
    if ended is not None:
        return {"why": "recording ended", "time": ended}
    try:
        written = os.path.getmtime(path)
    except OSError:
        return None  # gone or unreadable: the error says so
    if time.time() - written > stale_after_s:
        return {"why": f"no end line, and the file not written for over {stale_after_s:g} s", "time": written}
    return None
