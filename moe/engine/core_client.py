"""The API process's side of an engine core in its own process: start it, talk to it over a
ZeroMQ DEALER socket (asyncio), and notice when it dies.

`launch_cores(args)` starts `python -m moe.engine.core_process` on fresh ipc addresses, in a folder
/tmp/moe-core-<pid>-<random> that the launching process removes when it exits (atexit);
`reclaim_stale_temp_folders()` removes those of processes that were killed. `CoreProcessClient`
either launches its own core (one API process) or connects to one a launcher started (with
`--api-server-count N`, every API process connects to the same core), says hello and waits for
the "ready" answer (bounded, failing at once if the process exits). Its output loop hands every
step result / statistics update to `on_result` / `on_stats`, and calls `on_dead` once when the
core reports a failure or its process is gone.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

import zmq
import zmq.asyncio

from moe.config import EngineArgs
from moe.engine.core import CoreRequest, CoreStepResult, SchedulerStats
from moe.engine.serialization import decode, encode, pack_request, unpack_stats, unpack_step
from moe.multimodal.ipc import ipc_sender_cache
from moe.multimodal.shm_transport import shm_sender

logger = logging.getLogger("moe.entrypoints.serve")

_LIVENESS_POLL_S = 0.25


class EngineDeadError(RuntimeError):
    """The engine core process failed or exited: in-flight requests cannot finish."""


def core_layout(args: EngineArgs) -> tuple[int, EngineArgs]:
    """(number of engine core processes, the engine arguments of each).

    Data-parallel replicas without expert parallelism share nothing, so each gets an engine core
    process of its own (the API processes route to the least loaded). With expert parallelism the
    replicas' MoE layers exchange tokens every step, so they stay in one core whose scheduler
    deals requests to them (moe/engine/data_parallel.py) and whose executor keeps them in step."""
    if args.data_parallel_size > 1 and not args.enable_expert_parallel:
        return args.data_parallel_size, dataclasses.replace(args, data_parallel_size=1)
    return 1, args


def launch_cores(args: EngineArgs) -> tuple[list[subprocess.Popen], list[str]]:
    """Start the engine core processes on fresh ipc addresses; they exit when this process is gone.
    Core i of several sees its own slice of the GPUs (tensor x pipeline parallel size each)."""
    count, core_args = core_layout(args)
    folder = owned_temp_folder(CORE_FOLDER_PREFIX)
    gpus_per_core = core_args.tensor_parallel_size * core_args.pipeline_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(_cuda_device_count())]
    procs, addresses = [], []
    for i in range(count):
        address = f"ipc://{os.path.join(folder, f'core{i}.sock')}"
        env = dict(os.environ)
        if count > 1 and len(devices) >= count * gpus_per_core:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i * gpus_per_core:(i + 1) * gpus_per_core])
        if count > 1 and "OMP_NUM_THREADS" not in env:
            # CPU threads shared out: oversubscribed OpenMP threads spin against each other.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
        procs.append(subprocess.Popen([sys.executable, "-m", "moe.engine.core_process", address,
                                       json.dumps(dataclasses.asdict(core_args)), str(os.getpid())], env=env))
        addresses.append(address)
    return procs, addresses


CORE_FOLDER_PREFIX = "moe-core-"


def owned_temp_folder(prefix: str) -> str:
    """A fresh folder <tmp>/<prefix><this pid>-<random>, removed when this process exits normally;
    the pid in its name lets reclaim_stale_temp_folders() tell when it is left over."""
    folder = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    atexit.register(_remove_owned_folder, folder, os.getpid())
    return folder


def _remove_owned_folder(folder: str, owner: int) -> None:
    if os.getpid() == owner:  # not in a forked child that exits normally while the owner serves on
        shutil.rmtree(folder, ignore_errors=True)


def reclaim_stale_temp_folders(prefixes: tuple[str, ...]) -> list[str]:
    """Remove the folders <tmp>/<prefix><pid>-* whose owner process is gone (a killed server's);
    the paths removed. A live process's folder is never touched. (Folders named without a pid, by
    older versions, are left alone: nothing tells whose they are.)"""
    if not os.path.isdir("/proc"):  # process_alive needs /proc: better to leave them than to guess
        return []
    root = tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = next((m for p in prefixes if (m := re.fullmatch(re.escape(p) + r"(\d+)-[\w]+", name))), None)
        path = os.path.join(root, name)
        if m is None or process_alive(int(m.group(1))) or os.path.islink(path) or not os.path.isdir(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def process_alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class CoreProcessClient:
    def __init__(self, args: EngineArgs, on_result: Callable[[CoreStepResult], None],
                 on_stats: Callable[[SchedulerStats], None], on_dead: Callable[[str], None],
                 address: str | None = None, pid: int | None = None, proc: subprocess.Popen | None = None) -> None:
        """address / pid: a core already launched (by this process: pass its proc too; by a
        launcher: its pid is watched through /proc); without address the client launches one."""
        self.args = args
        self.on_result, self.on_stats, self.on_dead = on_result, on_stats, on_dead
        self.proc: subprocess.Popen | None = proc
        self.address, self.pid = address, pid
        self.dead: str | None = None
        self._ctx = zmq.asyncio.Context()
        self._socket = None
        self._task: asyncio.Task | None = None
        self.expert_load_meta: dict | None = None  # from the "ready" answer
        self.num_blocks: int | None = None  # the core's KV-cache blocks, from the "ready" answer
        # The API side of the IPC cache of processed images (keys only; the core keeps the pixels).
        self.ipc_cache = ipc_sender_cache(args)
        self.shm = None  # the shared-memory store of pixels to this core (made at start)
        self._controls: collections.deque[asyncio.Future] = collections.deque()  # control replies awaited, in order

    def _exit_status(self) -> str | None:
        """None while the core runs, else how it ended."""
        if self.proc is not None:
            return None if self.proc.poll() is None else f"status {self.proc.returncode}"
        return None if process_alive(self.pid) else "gone"

    async def start(self, timeout_s: float = 600.0) -> None:
        if self.address is None:
            procs, addresses = launch_cores(self.args)
            assert len(procs) == 1, "a client launches one core: launch several with launch_cores"
            self.proc, self.address = procs[0], addresses[0]
            self.pid = self.proc.pid
        self.shm = shm_sender(self.args)
        self._socket = self._ctx.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)
        await self._socket.send(encode(["hello"]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            status = self._exit_status()
            if status is not None:
                raise EngineDeadError(f"the engine core exited ({status}) while starting (its log is above)")
            if loop.time() > deadline:
                if self.proc is not None:
                    self.proc.kill()
                raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")
            if await self._socket.poll(int(_LIVENESS_POLL_S * 1000)):
                message = decode(await self._socket.recv())
                if message[0] == "ready":
                    self.pid = message[1]["pid"]
                    self.expert_load_meta = message[1].get("expert_load_meta")
                    self.num_blocks = message[1].get("num_blocks")
                    break
        self._task = asyncio.create_task(self._output_loop())

    async def _output_loop(self) -> None:
        try:
            while True:
                if not await self._socket.poll(int(_LIVENESS_POLL_S * 1000)):
                    status = self._exit_status()
                    if status is not None:
                        self._die(f"the engine core process exited ({status})")
                        return
                    continue
                message = decode(await self._socket.recv())
                kind = message[0]
                if kind == "step":
                    self.on_result(unpack_step(message))
                elif kind == "stats":
                    self.on_stats(unpack_stats(message[1]))
                elif kind == "control":
                    self._controls.popleft().set_result(message[1])
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
            while self._controls:  # no reply will come
                self._controls.popleft().set_exception(EngineDeadError(why))

    def _send(self, message: list) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        # zmq.asyncio send on a DEALER with room in its queue completes at once; the future is
        # not awaited so that the callers stay synchronous.
        self._socket.send(encode(message))

    def add_requests(self, requests: list[CoreRequest]) -> None:
        # Packed and sent at once, in order: the IPC cache's two sides see the same sequence.
        self._send(["add", [pack_request(r, self.ipc_cache, self.shm) for r in requests]])

    def abort(self, ids: list[str]) -> None:
        if ids and self.dead is None:
            self._send(["abort", ids])

    async def control(self, op: str, *args) -> dict:
        """A sleep-mode operation on the core (sleep, wake_up, is_sleeping): its reply, answered in order."""
        future = asyncio.get_running_loop().create_future()
        self._controls.append(future)
        self._send(["control", op, list(args)])
        return await future

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
        if self.shm is not None:
            self.shm.close()
