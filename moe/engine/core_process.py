"""The engine core in a process of its own (`moe serve`): `python -m moe.engine.core_process ADDRESS ARGS_JSON`.

One ZeroMQ ROUTER socket, bound at ADDRESS; every API process connects a DEALER to it (its
identity is how the core sends it the outputs of its requests). The loop: take every message
waiting (blocking only when there is no work), run one step, send each client the outputs of its
sequences. Messages are msgpack (moe/engine/serialization.py). When idle after a change (an abort freed
blocks) the core sends each client its statistics, so gauges like KV-cache usage go back to 0.

The process exits when the process that started it is gone, and after a failure it cannot
recover from (it tells the clients with a "dead" message first).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import zmq

from moe.config import EngineArgs
from moe.engine.core import CoreStepResult, EngineCore
from moe.engine.model_info import resolve_model_info
from moe.engine.serialization import decode, encode, pack_stats, pack_step, unpack_request
from moe.multimodal.ipc import ipc_receiver_cache
from moe.multimodal.processor_cache import ReceiverCache
from moe.multimodal.shm_transport import ShmPins, ShmPixels
from scheduler import RequestStatus
from scheduler.output import EngineCoreOutput

logger = logging.getLogger("moe.core")

_IDLE_POLL_MS = 500  # idle: how often the parent's liveness is checked


class CoreServer:
    def __init__(self, core: EngineCore, socket: zmq.Socket) -> None:
        self.core = core
        self.socket = socket
        self.clients: list[bytes] = []
        self.owner: dict[str, bytes] = {}  # sequence id -> the client that sent it
        self.ipc_caches: dict[bytes, ReceiverCache | None] = {}  # per client: the core side of its IPC cache
        self.pins = ShmPins()  # the shared-memory pixels of the running requests
        self.stats_dirty = False

    def handle(self, identity: bytes, message: list) -> None:
        kind = message[0]
        if kind == "add":
            if identity not in self.ipc_caches:
                self.ipc_caches[identity] = ipc_receiver_cache(self.core.info.args)
            for item in message[1]:
                req = unpack_request(item, self.ipc_caches[identity])
                if self.core.sleeping:  # sent by another API process before it knew: fails, the core goes on
                    why = f"the engine is asleep (level {self.core.sleeping}): POST /wake_up first"
                    self.socket.send_multipart([identity, pack_step(CoreStepResult(
                        outputs=[EngineCoreOutput(req.request_id, [], finish_reason="error")],
                        stats=self.core.stats(), errors={req.request_id: why}))])
                    continue
                for m in req.mm_items:
                    if isinstance(m.pixel_values, ShmPixels):
                        self.pins.hold(req.request_id, m.pixel_values)
                try:
                    self.core.add_request(req)
                except Exception:
                    self.pins.release(req.request_id)
                    raise
                self.owner[req.request_id] = identity
        elif kind in ("abort", "stop"):
            ids = [rid for rid in message[1] if self.owner.pop(rid, None) is not None]
            for rid in ids:
                self.pins.release(rid)
            self.core.abort_requests(ids, RequestStatus.FINISHED_ABORTED if kind == "abort"
                                     else RequestStatus.FINISHED_STOPPED)
        elif kind == "control":  # sleep mode (the server's development endpoints): ["control", op, args]
            self._control(identity, message[1], message[2])
            return
        elif kind == "hello":
            if identity not in self.clients:
                self.clients.append(identity)
            tracker = self.core.expert_load
            self.socket.send_multipart([identity, encode(["ready", {
                "pid": os.getpid(), "num_blocks": self.core.scheduler.kv.num_blocks,
                "expert_load_meta": tracker.meta.to_json() if tracker is not None else None}])])
            return
        else:
            logger.warning("unknown message %r from a client: ignored", kind)
            return
        self.stats_dirty = True

    def _control(self, identity: bytes, op: str, args: list) -> None:
        """sleep [level] / wake_up / is_sleeping; the reply ["control", {"sleeping": level, "error": ...}]."""
        reply: dict = {"error": None}
        try:
            if op == "sleep":
                self.core.sleep(*args)
            elif op == "wake_up":
                self.core.wake_up()
            elif op != "is_sleeping":
                raise ValueError(f"unknown control operation {op!r}")
        except (RuntimeError, ValueError, TypeError) as e:
            reply["error"] = str(e)
        reply["sleeping"] = self.core.sleeping
        self.socket.send_multipart([identity, encode(["control", reply])])

    def step(self) -> None:
        result = self.core.step()
        # Each client gets its own sequences' outputs, queue times and errors.
        parts: dict[bytes, CoreStepResult] = {
            c: CoreStepResult(stats=result.stats, expert_load_windows=result.expert_load_windows) for c in self.clients}
        for co in result.outputs:
            if co.finished:
                owner = self.owner.pop(co.req_id, None)
                self.pins.release(co.req_id)  # its images' pixels in shared memory may go
            else:
                owner = self.owner.get(co.req_id)
            if owner is not None:
                parts.setdefault(owner, CoreStepResult(stats=result.stats)).outputs.append(co)
        for field_name in ("queue_times", "errors"):
            for rid, value in getattr(result, field_name).items():
                owner = self.owner.get(rid)
                if owner is not None:
                    part = parts.setdefault(owner, CoreStepResult(stats=result.stats))
                    getattr(part, field_name)[rid] = value
        for identity, part in parts.items():
            if part.outputs or part.queue_times or part.errors or part.expert_load_windows:
                self.socket.send_multipart([identity, pack_step(part)])
        self.stats_dirty = True

    def send_stats(self) -> None:
        # Gone idle: the expert load of the last steps goes out now, not after the next request.
        window = self.core.fold_expert_load()
        if window is not None:
            data = pack_step(CoreStepResult(stats=self.core.stats(), expert_load_windows=[window]))
            for identity in self.clients:
                self.socket.send_multipart([identity, data])
        data = encode(["stats", pack_stats(self.core.stats())])
        for identity in self.clients:
            self.socket.send_multipart([identity, data])
        self.stats_dirty = False

    def broadcast_dead(self, error: str) -> None:
        for identity in self.clients:
            self.socket.send_multipart([identity, encode(["dead", error])], flags=zmq.NOBLOCK)

    def run(self, parent_pid: int) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            busy = self.core.has_unfinished_requests()
            if busy or poller.poll(0 if self.stats_dirty else _IDLE_POLL_MS):
                while True:
                    try:
                        identity, data = self.socket.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(identity, decode(data))
            if self.core.has_unfinished_requests():
                self.step()
            elif self.stats_dirty:
                self.send_stats()
            elif os.getppid() != parent_pid:
                logger.info("the API process is gone: the engine core exits")
                return
            self.pins.sweep()  # the shared-memory stores of API processes that died (at most once a second)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    address, args_json, parent_pid = argv[0], argv[1], int(argv[2])
    args = EngineArgs(**json.loads(args_json))
    core = EngineCore(resolve_model_info(args))
    ctx = zmq.Context()
    socket = ctx.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 1000)
    # A ROUTER drops what it cannot queue for a peer, and a dropped output would hang a request:
    # room for many steps' outputs of a slow API process.
    socket.setsockopt(zmq.SNDHWM, 1 << 20)
    socket.bind(address)
    server = CoreServer(core, socket)
    logger.info("engine core %d serving at %s", os.getpid(), address)
    try:
        server.run(parent_pid)
    except Exception as exc:
        logger.exception("the engine core failed")
        server.broadcast_dead(f"{type(exc).__name__}: {exc}")
        time.sleep(0.2)  # let the message leave
        return 1
    finally:
        core.shutdown()
        socket.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
