"""Run a function on N gloo ranks in spawned processes, with hard time limits.

Every rank joins a fresh gloo group on localhost (free port), runs `fn(rank, world_size, *args)`
and returns its picklable result, or the traceback of what it raised. A bug that leaves one
rank inside a collective fails in `collective_timeout_s` (gloo raises); anything stuck beyond
`timeout_s` is terminated by the parent, so a test fails instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_path: str, coll_timeout_s: float):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # N ranks share 2 cores: oversubscribed threads only slow things down
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=coll_timeout_s))
        try:
            result = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        result = ("error", traceback.format_exc())
    with open(out_path, "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn, world_size: int, args: tuple = (), timeout_s: float = 60.0,
              collective_timeout_s: float = 20.0) -> list:
    """Results of `fn` on every rank, in rank order; raises AssertionError on any failure."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world_size)]
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(r, world_size, port, fn, args, paths[r], collective_timeout_s))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:  # only the processes started here
            procs[r].terminate()
            procs[r].join(5)
        results, errors = [], []
        for r, path in enumerate(paths):
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}"
                              f"{', timed out' if r in hung else ''})")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
    if errors:
        raise AssertionError("\n".join(errors))
    return results

