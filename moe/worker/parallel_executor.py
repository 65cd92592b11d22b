"""Multi-rank executors.

`MultiprocExecutor` (one node; `LLM(..., tensor_parallel_size=2)` etc.): this process is the
driver and holds no rank. It spawns world = PP x DP x TP worker processes (torch.multiprocessing
spawn; gloo on CPU, NCCL on GPU, rank r on cuda:r), each building only its shard. Every step it
sends each worker its replica's SchedulerOutput (pickled once per replica, the same bytes to
every rank of it: a broadcast over pipes) together with the tokens the replica's driver rank
sampled last step, and waits for every rank's reply.

Faults: the driver waits on the pipes *and* the process sentinels with a deadline, so a worker
that dies is reported within moments ("worker rank 1 (pid ...) died ..."), a worker that raises
is reported with its traceback, and a step that outlives MOE_STEP_TIMEOUT_S (default 300 s, as
vLLM's execute-model timeout; CUDA-graph capture and the model load run under
MOE_WORKER_START_TIMEOUT_S, default 900 s) fails naming the rank that did not answer: on Linux
the state of each silent worker is read from /proc, so a stopped (SIGSTOP) or still computing
rank is told apart from its peers that wait for it in a collective. A script without an
`if __name__ == "__main__":` guard is reported as such (spawn re-imports the main module, and the
workers would build an LLM of their own). Workers are daemon processes, each also exits when
its driver disappears (pipe EOF, parent watch); a weakref finalizer (which also runs at
interpreter exit) stops them when the LLM is deleted. After a fault the executor is closed and
every later call raises the same error.

`TorchrunExecutor` (one or several nodes): `torchrun --nproc-per-node N ... script.py` starts
the ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the environment). Every rank runs
the same script and the whole engine (SPMD, like vLLM's external launcher): each builds the
same schedulers from the same prompts, executes its own replica's batch, and one all_gather of
small Python objects per step gives every rank every replica's sampled tokens (and checks that
the ranks scheduled the same batches, so a script that feeds ranks different prompts fails
loudly). Every rank returns the same outputs. Two nodes of 8 GPUs, TP=8 x PP=2:

    # on each node (NODE_RANK 0 and 1), the same script calling LLM(..., tensor_parallel_size=8,
    # pipeline_parallel_size=2) and generate() with the same prompts on every rank:
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \
        --master-addr $HEAD_NODE_IP --master-port 29500 my_script.py
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection as mp_connection
import os
import pickle
import socket
import sys
import time
import weakref
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.config import ModelConfig
from models.parallel.state import ParallelLayout, collective_timeout, init_parallel_state, reset_parallel_state
from moe.config import EngineArgs
from moe.expert_load.counters import sum_snapshots
from moe.worker.executor import Executor
from moe.worker.model_runner import ModelRunnerOutput
from moe.worker.routed_experts import merge_stage_routing
from moe.worker.worker import Worker, WorkerSpec, worker_main
from scheduler import KVCacheGroup, SchedulerOutput

logger = logging.getLogger("moe.worker.executor")


DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_START_TIMEOUT_S = 900.0
# The exit code of a worker that found itself building an LLM while spawn re-imported the main module.
EXIT_NO_MAIN_GUARD = 87
_NO_MAIN_GUARD = (
    "the script that makes the LLM has no `if __name__ == \"__main__\":` guard. A parallel layout starts its "
    "workers with multiprocessing's spawn, which re-imports the main module in every worker, so the worker "
    "ran the script's top level and built an LLM of its own. Put the code that makes and uses the LLM under "
    "`if __name__ == \"__main__\":`")


def exit_if_reimported_by_spawn() -> None:
    """Called when an LLM engine is made: in a process that spawn is still starting (it is
    re-importing the main module), making one is the missing-main-guard mistake; say so and exit
    with EXIT_NO_MAIN_GUARD, which the driver recognises."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        sys.stderr.write(f"moe-runtime: {multiprocessing.current_process().name}: {_NO_MAIN_GUARD}\n")
        sys.stderr.flush()
        raise SystemExit(EXIT_NO_MAIN_GUARD)


def _process_state(pid: int) -> str | None:
    """The one-letter state of a process from /proc (R running, S sleeping, T stopped, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe_silent_ranks(pids: dict[int, int]) -> str:
    """Which of the silent ranks (rank -> pid) hold the others up: stopped ones first, else the
    ones still computing; the rest are waiting for them (in a collective)."""
    states = {r: _process_state(pid) for r, pid in pids.items()}
    stopped = sorted(r for r, s in states.items() if s in ("T", "t"))
    busy = sorted(r for r, s in states.items() if s == "R")
    culprits, why = (stopped, "is stopped (SIGSTOP or a debugger)") if stopped else \
        (busy, "is still computing") if busy else ([], "")
    if not culprits:
        return f"worker rank(s) {sorted(pids)} did not answer"
    names = ", ".join(f"rank {r} (pid {pids[r]})" for r in culprits)
    others = sorted(set(pids) - set(culprits))
    waiting = f"; rank(s) {others} are waiting, likely for it in a collective" if others else ""
    return f"worker {names} did not answer: it {why}{waiting}"


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ and "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layout(args: EngineArgs) -> ParallelLayout:
    return ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size)


def step_max_tokens(sos: list[SchedulerOutput]) -> int:
    """The most tokens any replica runs this step (a dummy batch runs one): the bound a fixed-capacity
    dispatcher checks, identical on every rank (all2all/low_latency.py)."""
    return max(max((so.total_num_scheduled_tokens for so in sos), default=0), 1)


def _dummy_flags(layout: ParallelLayout, enable_ep: bool, sos: list[SchedulerOutput]) -> list[bool]:
    """Replicas that must run a dummy batch: empty while another replica works and the MoE
    collectives span replicas (EP with DP > 1)."""
    if not (enable_ep and layout.dp > 1) or all(so.is_empty for so in sos):
        return [False] * len(sos)
    return [so.is_empty for so in sos]


def replica_output(layout: ParallelLayout, d: int, replies: dict[int, object]) -> ModelRunnerOutput:
    """Replica d's step output: its driver's, with the routed experts of every pipeline stage
    (each stage's TP rank 0 reports its layers') joined into one [T, L, K] array."""
    out = replies[layout.driver_rank(d)]
    parts = [(o.routed_experts, o.routed_layers) for r in layout.replica_ranks(d)
             if (o := replies.get(r)) is not None and o.routed_experts is not None]
    if parts:
        out.routed_experts, out.routed_layers = merge_stage_routing(parts)
    return out


class WorkerFailure(RuntimeError):
    """A worker process died, raised, or stopped answering."""


def _stop_workers(procs: list, conns: list, timeout_s: float = 5.0) -> None:
    """Ask, then terminate, then kill; only the processes this executor started. Idempotent."""
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            try:
                conn.send_bytes(pickle.dumps(("shutdown", ())))
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass


class MultiprocExecutor(Executor):
    def __init__(self, model_cls: type, config: ModelConfig, model_path: str, args: EngineArgs,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> None:
        self.args = args
        self.layout = layout = _layout(args)
        world = layout.world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda" and world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {world} "
                             f"processes need {world} GPUs on this node, but torch sees {torch.cuda.device_count()}")
        self.step_timeout_s = float(os.environ.get("MOE_STEP_TIMEOUT_S", DEFAULT_STEP_TIMEOUT_S))
        start_timeout_s = float(os.environ.get("MOE_WORKER_START_TIMEOUT_S", DEFAULT_START_TIMEOUT_S))
        spec = WorkerSpec(model_cls, config, model_path, args, device.type, dtype, tuple(eos_token_ids))
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, (os.cpu_count() or 1) // world) if device.type == "cpu" else 1
        self.procs, self.conns = [], []
        self._error: str | None = None
        # Registered before the first start: whatever happens next, the workers get stopped.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        for rank in range(world):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, name=f"moe-worker-rank{rank}", daemon=True,
                               args=(rank, world, init_method, backend, spec, child_conn, os.getpid(), threads))
            proc.start()
            child_conn.close()  # the worker holds its end: EOF here means it is gone
            self.procs.append(proc)
            self.conns.append(parent_conn)
        logger.info("Started %d worker processes (%s, tp=%d pp=%d dp=%d, pids %s)", world, backend, layout.tp,
                    layout.pp, layout.dp, [p.pid for p in self.procs])
        self._gather(range(world), start_timeout_s, "starting")
        self._last_sampled: list[dict[str, list[int]]] = [{} for _ in range(layout.dp)]
        self.num_dummy_batches = 0  # replica-steps run as dummy batches (observability, tests)
        # Async steps: how many launched steps are not collected yet, and the replies of those
        # read early (another call's replies queue behind them on the pipes).
        self._launched = 0
        self._early: list[dict[int, object]] = []

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- transport ---------------------------------------------------------------------
    def _fail(self, message: str) -> None:
        self._error = message
        self._finalizer()  # stop every worker now; later calls raise `message`
        raise WorkerFailure(message)

    def _check_open(self) -> None:
        if self._error is not None:
            raise WorkerFailure(f"the executor is closed after an earlier failure: {self._error}")

    def _send(self, ranks, payload: bytes) -> None:
        for r in ranks:
            try:
                self.conns[r].send_bytes(payload)
            except (OSError, ValueError):
                self._gather([r], 1.0, "sending to")  # reports the death with the exit code
                self._fail(f"worker rank {r} (pid {self.procs[r].pid}) is unreachable")

    def _gather(self, ranks, timeout_s: float, what: str) -> dict[int, object]:
        """Each rank's reply; raises WorkerFailure naming the rank on death, error or timeout."""
        pending = {self.conns[r]: r for r in ranks}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = mp_connection.wait(list(pending) + list(sentinels), timeout=max(left, 0.0)) if left > 0 else []
            if not ready:
                silent = describe_silent_ranks({r: self.procs[r].pid for r in pending.values()})
                self._fail(f"{silent} within {timeout_s:g} s while {what} the model (the limit is "
                           f"{'MOE_WORKER_START_TIMEOUT_S' if what == 'starting' else 'MOE_STEP_TIMEOUT_S'})")
            for obj in ready:
                if obj in pending:
                    r = pending[obj]
                    try:
                        status, value = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        self._dead(r, what)
                    if status == "error":
                        self._fail(f"worker rank {r} raised while {what} the model:\n{value}")
                    results[r] = value
                    del pending[obj]
                else:  # a process sentinel: that worker has exited
                    r = sentinels[obj]
                    # A rank that replied "error" just before exiting is reported with its traceback.
                    if self.conns[r] in pending and self.conns[r].poll():
                        continue
                    self._dead(r, what)
        return results

    def _dead(self, rank: int, what: str) -> None:
        proc = self.procs[rank]
        proc.join(1.0)
        if proc.exitcode == EXIT_NO_MAIN_GUARD:
            self._fail(f"worker rank {rank} (pid {proc.pid}) exited at start: {_NO_MAIN_GUARD}")
        self._fail(f"worker rank {rank} (pid {proc.pid}) died while {what} the model "
                   f"(exit code {proc.exitcode})")

    def _call_all(self, method: str, *args, timeout_s: float | None = None) -> dict[int, object]:
        self._check_open()
        self._read_launched_replies()
        ranks = range(self.layout.world_size)
        self._send(ranks, pickle.dumps((method, args)))
        return self._gather(ranks, timeout_s or self.step_timeout_s, "running")

    def _read_launched_replies(self) -> None:
        """Read the replies of launched steps now (kept for `collect`), so that the next call's
        replies are its own."""
        while len(self._early) < self._launched:
            self._early.append(self._gather(range(self.layout.world_size), self.step_timeout_s, "running"))

    # ---- Executor ----------------------------------------------------------------------
    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        # Each rank sizes its own cache; a replica's ranks share block ids, so take the minimum.
        return min(self._call_all("determine_num_blocks", max_num_seqs, max_model_len,
                                  max_num_batched_tokens).values())

    def initialize_cache(self, groups: list[KVCacheGroup]) -> None:
        self._call_all("initialize_cache", groups)

    def execute_models(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        self._check_open()
        self._read_launched_replies()
        layout = self.layout
        dummy = _dummy_flags(layout, self.args.enable_expert_parallel, scheduler_outputs)
        self.num_dummy_batches += sum(dummy)
        max_tokens = step_max_tokens(scheduler_outputs)
        for d, so in enumerate(scheduler_outputs):
            payload = pickle.dumps(("execute", (so, self._last_sampled[d], dummy[d], max_tokens)),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            self._send(layout.replica_ranks(d), payload)
        replies = self._gather(range(layout.world_size), self.step_timeout_s, "running")
        outs = [replica_output(layout, d, replies) for d in range(layout.dp)]
        self._last_sampled = [o.sampled for o in outs]
        return outs

    @property
    def supports_async_steps(self) -> bool:
        """One replica of one stage: the TP ranks share the sampled tokens among themselves
        (Worker.execute's share_sampled), so a step can be sent before the last one's reply."""
        return self.layout.dp == 1 and self.layout.pp == 1

    def launch(self, scheduler_output: SchedulerOutput, prev=None):
        """Send one step without waiting: the workers run it as soon as the step before is done
        (they hold its tokens by then), while this process schedules the next. Returns a handle
        for `collect` (steps are collected in launch order)."""
        if not self.supports_async_steps:
            raise ValueError("async steps need one replica of one pipeline stage")
        self._check_open()
        payload = pickle.dumps(("execute", (scheduler_output, None, False, step_max_tokens([scheduler_output]),
                                            True)), protocol=pickle.HIGHEST_PROTOCOL)
        self._send(range(self.layout.world_size), payload)
        self._launched += 1
        return scheduler_output

    def collect(self, pending) -> ModelRunnerOutput:
        """The driver rank's reply to the oldest launched step."""
        if not self._launched:
            raise RuntimeError("collect without a launched step")
        self._check_open()
        replies = self._early.pop(0) if self._early else \
            self._gather(range(self.layout.world_size), self.step_timeout_s, "running")
        self._launched -= 1
        return replies[self.layout.driver_rank(0)]

    def expert_load_snapshot(self) -> dict | None:
        snaps = [s for s in self._call_all("expert_load_snapshot").values() if s is not None]
        return sum_snapshots(snaps) if snaps else None

    def apply_expert_placement(self, phys_to_log_by_layer: dict[int, list[int]]) -> int:
        return sum(self._call_all("apply_expert_placement", phys_to_log_by_layer).values())

    def update_weights(self, named_tensors: list) -> int:
        return sum(self._call_all("update_weights", list(named_tensors)).values())

    def sleep(self, level: int) -> None:
        self._call_all("sleep", level)

    def wake_up(self) -> None:
        self._call_all("wake_up")

    def shutdown(self) -> None:
        self._finalizer()


class TorchrunExecutor(Executor):
    """This process is one rank of a torchrun launch (see the module docstring)."""

    def __init__(self, model_cls: type, config: ModelConfig, model_path: str, args: EngineArgs,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> None:
        self.args = args
        self.layout = layout = _layout(args)
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if world != layout.world_size:
            raise ValueError(f"torchrun started WORLD_SIZE={world} processes, but tensor_parallel_size x "
                             f"pipeline_parallel_size x data_parallel_size = {layout.world_size}")
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                    timeout=collective_timeout())
        self.state = init_parallel_state(layout, rank, args.enable_expert_parallel, args.all2all_backend,
                                         args.expert_placement_strategy)
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        spec = WorkerSpec(model_cls, config, model_path, args, device.type, dtype, tuple(eos_token_ids))
        self.worker = Worker(spec, device)
        self._closed = False

    @property
    def runner(self):
        return self.worker.runner

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        n = self.worker.determine_num_blocks(max_num_seqs, max_model_len, max_num_batched_tokens)
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.state.cpu_group)
        return int(t.item())

    def initialize_cache(self, groups: list[KVCacheGroup]) -> None:
        self.worker.initialize_cache(groups)

    def execute_models(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        s, layout = self.state, self.layout
        dummy = _dummy_flags(layout, self.args.enable_expert_parallel, scheduler_outputs)
        mine = self.worker.execute(scheduler_outputs[s.dp_rank], None, dummy[s.dp_rank],
                                   step_max_tokens(scheduler_outputs))
        digest = zlib.crc32(repr([sorted(so.num_scheduled_tokens.items()) for so in scheduler_outputs]).encode())
        gathered: list = [None] * layout.world_size
        dist.all_gather_object(gathered, (digest, mine), group=s.cpu_group)
        if any(g[0] != digest for g in gathered):
            bad = [r for r, g in enumerate(gathered) if g[0] != digest]
            raise RuntimeError(f"ranks {bad} scheduled a different batch than rank {s.rank}: under torchrun every "
                               "rank must call generate() with the same prompts and sampling parameters")
        outs = [replica_output(layout, d, {r: g[1] for r, g in enumerate(gathered)}) for d in range(layout.dp)]
        if not self.worker.runner.is_driver:
            self.worker.runner.apply_sampled(outs[s.dp_rank].sampled)
        return outs

    def expert_load_snapshot(self) -> dict | None:
        gathered: list = [None] * self.layout.world_size
        dist.all_gather_object(gathered, self.worker.expert_load_snapshot(), group=self.state.cpu_group)
        snaps = [s for s in gathered if s is not None]
        return sum_snapshots(snaps) if snaps else None

    def apply_expert_placement(self, phys_to_log_by_layer: dict[int, list[int]]) -> int:
        moved = torch.tensor([self.worker.apply_expert_placement(phys_to_log_by_layer)], dtype=torch.int64)
        dist.all_reduce(moved, group=self.state.cpu_group)
        return int(moved.item())

    def update_weights(self, named_tensors: list) -> int:
        """Every rank's script gives the same tensors (torchrun: each rank calls the same methods)."""
        taken = torch.tensor([self.worker.update_weights(named_tensors)], dtype=torch.int64)
        dist.all_reduce(taken, group=self.state.cpu_group)
        return int(taken.item())

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        reset_parallel_state()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
