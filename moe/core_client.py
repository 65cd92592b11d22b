"""The API process's side of an engine core in its own process: start it, talk to it over a
ZeroMQ DEALER socket (asyncio), and notice when it dies.

`CoreProcessClient.start()` launches `python -m moe.core_process` on a fresh ipc address and waits
for its "ready" answer (bounded, and failing at once if the process exits). Its output loop hands
every step result / statistics update to `on_result` / `on_stats`, and calls `on_dead` once when
the core reports a failure or its process is gone.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Callable

import zmq
import zmq.asyncio

from moe.config import EngineArgs
from moe.engine_core import CoreRequest, CoreStepResult, SchedulerStats
from moe.serialization import decode, encode, pack_request, unpack_stats, unpack_step

logger = logging.getLogger("moe.serve")

_LIVENESS_POLL_S = 0.25


class EngineDeadError(RuntimeError):
    """The engine core process failed or exited: in-flight requests cannot finish."""


class CoreProcessClient:
    def __init__(self, args: EngineArgs, on_result: Callable[[CoreStepResult], None],
                 on_stats: Callable[[SchedulerStats], None], on_dead: Callable[[str], None]) -> None:
        self.args = args
        self.on_result, self.on_stats, self.on_dead = on_result, on_stats, on_dead
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.dead: str | None = None
        self._dir = tempfile.mkdtemp(prefix="moe-core-")
        self.address = f"ipc://{os.path.join(self._dir, 'core0.sock')}"
        self._ctx = zmq.asyncio.Context()
        self._socket = None
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = 600.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "moe.core_process", self.address,
                                      json.dumps(dataclasses.asdict(self.args)), str(os.getpid())])
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        await self._socket.send(encode(["hello"]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineDeadError(f"the engine core exited with status {self.proc.returncode} while starting "
                                      "(its log is above)")
            if loop.time() > deadline:
                self.proc.kill()
                raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")
            if await self._socket.poll(int(_LIVENESS_POLL_S * 1000)):
                message = decode(await self._socket.recv())
                if message[0] == "ready":
                    self.pid = message[1]["pid"]
                    break
        self._task = asyncio.create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._socket.poll(int(_LIVENESS_POLL_S * 1000)):
                    if self.proc.poll() is not None:
                        self._die(f"the engine core process exited (status {self.proc.returncode})")
                        return
                    continue
                message = decode(await self._socket.recv())
                kind = message[0]
                if kind == "step":
                    self.on_result(unpack_step(message))
                elif kind == "stats":
                    self.on_stats(unpack_stats(message[1]))
                elif kind == "dead":
                    self._die(f"the engine core failed: {message[1]}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug on this side: no request may hang on it
            logger.exception("the engine core client failed")
            self._die(f"the engine core client failed: {type(exc).__name__}: {exc}")

    def _die(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            logger.error("%s", why)
            self.on_dead(why)

    def _send(self, message: list) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        # zmq.asyncio send on a DEALER with room in its queue completes at once; the future is
        # not awaited so that the callers stay synchronous.
        self._socket.send(encode(message))

    def add_requests(self, requests: list[CoreRequest]) -> None:
        self._send(["add", [pack_request(r) for r in requests]])

    def abort(self, ids: list[str]) -> None:
        if ids and self.dead is None:
            self._send(["abort", ids])

    def stop(self, ids: list[str]) -> None:
        if ids and self.dead is None:
            self._send(["stop", ids])

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
            except asyncio.TimeoutError:
                self.proc.kill()
        if self._socket is not None:
            self._socket.close()
        self._ctx.term()
