"""Renderer child processes for chat templates (`moe serve`: `use_renderer_processes`). The
sandbox's checks (moe.engine.template_sandbox) run between steps of a render; a template that
overruns its deadline inside a single C call, which no such check can stop, is stopped here by
killing the process it renders in, and a child's memory is capped (RLIMIT_AS), which no thread can
give. A child runs `serve_renders`: one JSON request a line on stdin, one JSON reply a line on stdout.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time

from moe.engine.template_sandbox import TIMEOUT_ENV, TemplateLimits, render_here, short_error

_RENDERER_MEMORY_BYTES = 1 << 30  # address space of a renderer process
_KILL_GRACE_S = 0.5  # past its deadline, a renderer process that has not answered is killed
_START_TIMEOUT_S = 30.0


def _to_line(obj) -> bytes:
    """One JSON line of UTF-8 (ensure_ascii would make non-ASCII text 6 bytes a character; lone
    surrogates, which JSON strings can hold, pass through as such)."""
    return json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"


def _from_line(line: bytes):
    return json.loads(line.decode("utf-8", "surrogatepass"))


class _RendererProcess:
    """A child process rendering one template at a time: JSON lines in on stdin, out on stdout."""

    def __init__(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-c", "import moe.engine.template_renderers as t; t.serve_renders()"]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        # Started once it says so: its start-up (~0.2 s) does not count against a render's deadline.
        if self.ask(None, time.monotonic() + _START_TIMEOUT_S, 1 << 10) != {"ready": True}:
            self.kill()
            raise ValueError(f"the chat template renderer process did not start within {_START_TIMEOUT_S:g} s")

    def ask(self, request: bytes | None, deadline: float, max_reply: int) -> dict | None:
        """The reply (to `request`, or None: the next line), or None when the deadline passed
        first. EOFError: the process died."""
        try:
            if request is not None:
                self.proc.stdin.write(request)
                self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise EOFError from None
        fd = self.proc.stdout.fileno()  # read raw: the buffered reader never reads ahead
        poller = select.poll()  # not select.select: an API process can hold fds above 1024
        poller.register(fd, select.POLLIN)
        chunks, size = [], 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not poller.poll(remaining * 1000):
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            size += len(chunk)
            if chunk.endswith(b"\n"):
                return _from_line(b"".join(chunks))
            if size > max_reply:
                raise EOFError  # not what a renderer writes: treat it as broken

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _RendererPool:
    def __init__(self, size: int) -> None:
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[_RendererProcess] = []
        self._all: set[_RendererProcess] = set()
        self._closed = False

    def render(self, source: str, context: dict, limits: TemplateLimits) -> str | None:
        """The rendered text; None when the context is not JSON (then render here). ValueError on failure."""
        try:
            request = _to_line({"source": source, "context": context,
                                "limits": [limits.timeout_s, limits.max_output_chars, limits.max_source_chars]})
        except (TypeError, ValueError):
            return None
        with self._slots:
            worker = self._take()
            if worker is None:
                return None  # shutting down
            healthy = False
            try:
                reply = worker.ask(request, time.monotonic() + limits.timeout_s + _KILL_GRACE_S,
                                   12 * limits.max_output_chars + (64 << 10))
                healthy = reply is not None
            except EOFError:
                if self._closed:
                    raise ValueError("the server is shutting down: the chat template's render was stopped") from None
                code = worker.proc.poll()
                raise ValueError(f"the chat template's renderer process died (exit status {code}) while rendering: "
                                 f"the template may need more than the {_RENDERER_MEMORY_BYTES >> 20} MiB of memory "
                                 "a renderer may use") from None
            finally:
                self._give_back(worker, healthy)
        if reply is None:
            raise ValueError(f"the chat template took longer than {limits.timeout_s:g} s to render (the limit, "
                             f"{TIMEOUT_ENV}); its renderer was stopped")
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["text"]

    def _take(self) -> _RendererProcess | None:
        with self._lock:
            if self._closed:
                return None
            if self._idle:
                return self._idle.pop()
            worker = _RendererProcess()
            self._all.add(worker)
            return worker

    def _give_back(self, worker: _RendererProcess, healthy: bool) -> None:
        with self._lock:
            if healthy and not self._closed:
                self._idle.append(worker)
                return
            self._all.discard(worker)
        worker.kill()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:  # a render in flight gets EOF: its request fails, it does not hang
            w.kill()


_pool: _RendererPool | None = None
_pool_users = 0
_pool_lock = threading.Lock()


def use_renderer_processes(count: int) -> None:
    """From now on, render chat templates in up to `count` child processes (started as needed)
    rather than in the calling thread. Each call needs a stop_renderer_processes() call."""
    global _pool, _pool_users
    with _pool_lock:
        if _pool is None:
            _pool = _RendererPool(count)
        _pool_users += 1


def stop_renderer_processes() -> None:
    """Undo one use_renderer_processes(); the last one stops the processes."""
    global _pool, _pool_users
    with _pool_lock:
        _pool_users = max(_pool_users - 1, 0)
        if _pool_users or _pool is None:
            return
        pool, _pool = _pool, None
    pool.close()


def render_in_renderer_process(source: str, context: dict, limits: TemplateLimits) -> str | None:
    """The rendered text, from a renderer process; None when use_renderer_processes() is not in
    effect or the context is not JSON (then render here). ValueError on failure."""
    pool = _pool
    return pool.render(source, context, limits) if pool is not None else None


def serve_renders() -> None:
    """A renderer process's main loop: one JSON request a line on stdin, one JSON reply a line on
    stdout; ends at EOF (the API process closed the pipe or is gone)."""
    import faulthandler
    import resource
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops this process
    try:
        resource.setrlimit(resource.RLIMIT_AS, (_RENDERER_MEMORY_BYTES, _RENDERER_MEMORY_BYTES))
    except (ValueError, OSError):
        pass
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # fd 1 carries the replies only
    devnull = open(os.devnull, "w")
    replies.write(b'{"ready": true}\n')
    replies.flush()
    for line in requests:
        try:
            request = _from_line(line)
            limits = TemplateLimits(*request["limits"])
            # Past the deadline with the server gone (nobody to kill this process), or stuck in
            # one C call (no check runs): faulthandler's watchdog thread ends it without the GIL.
            faulthandler.dump_traceback_later(limits.timeout_s + 4 * _KILL_GRACE_S, exit=True, file=devnull)
            try:
                reply = {"text": render_here(request["source"], request["context"], limits)}
            finally:
                faulthandler.cancel_dump_traceback_later()
        except ValueError as e:
            reply = {"error": str(e)}
        except BaseException as e:  # noqa: BLE001 (whatever it is, the API process gets an answer)
            reply = {"error": f"the chat template could not be rendered ({type(e).__name__}: {short_error(e)})"}
        try:
            out = _to_line(reply)
        except MemoryError:
            out = b'{"error": "the chat template\'s output is too large to send back"}\n'
        replies.write(out)
        replies.flush()
