"""AsyncLLM: the engine as an API process sees it. Input processing runs here in a thread pool
(`run_input`: tokenising, chat templates and image decoding take seconds on long inputs, which the
event loop must not wait for), output processing in the event loop's thread; the engine core(s)
run in their own processes (moe/engine/core_client.py). Chat templates render in child processes
(moe/engine/template_renderers.py), where a deadline can be enforced by killing them.

The pool has $MOE_MEDIA_LOADING_THREAD_COUNT threads (else $VLLM_MEDIA_LOADING_THREAD_COUNT, vLLM's
name; default 8), and as many template renderer processes at most.

With several engine cores (data parallel without expert parallelism), a new request goes to the
least-loaded core: the waiting + running count each core last reported, plus the sequences this
process sent it since. The gauges show the sums over the cores (KV-cache usage: the mean).

`generate()` is an async iterator of per-step deltas of one request; leaving it early (a client
that disconnected, a cancelled task) aborts the request in the core, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import AsyncIterator, Callable, TypeVar

from fastapi import HTTPException

from moe.config import EngineArgs
from moe.engine.chat_template import template_limits
from moe.engine.core import CoreStepResult, SchedulerStats
from moe.engine.core_client import CoreProcessClient, EngineDeadError, launch_cores
from moe.engine.input_processor import InputProcessor, ProcessedPrompt
from moe.engine.metrics import EngineMetrics
from moe.engine.model_info import resolve_model_info
from moe.engine.output_processor import OutputProcessor
from moe.engine.template_renderers import stop_renderer_processes, use_renderer_processes
from moe.expert_load.recording import ExpertLoadMeta, ExpertLoadWindow, windows_to_dashboard_json
from moe.expert_load.tracker import KEPT_WINDOWS
from moe.outputs import RequestOutput
from moe.sampling_params import SamplingParams

logger = logging.getLogger("moe.entrypoints.serve")

MEDIA_THREADS_ENV_VARS = ("MOE_MEDIA_LOADING_THREAD_COUNT", "VLLM_MEDIA_LOADING_THREAD_COUNT")
DEFAULT_MEDIA_THREADS = 8
# Texts at least this long are tokenised through encode_batch (see _GilReleasingTokenizer).
_GIL_FREE_ENCODE_CHARS = 16 << 10

T = TypeVar("T")


def media_loading_thread_count(environ: Mapping[str, str] = os.environ) -> int:
    """The input pool's size: $MOE_MEDIA_LOADING_THREAD_COUNT, else $VLLM_MEDIA_LOADING_THREAD_COUNT, else 8."""
    for name in MEDIA_THREADS_ENV_VARS:
        raw = environ.get(name)
        if raw is None or raw.strip() == "":
            continue
        try:
            count = int(raw)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{name}={raw!r} must be a positive integer (threads for input processing)")
        return count
    return DEFAULT_MEDIA_THREADS


class _GilReleasingTokenizer:
    """The model's tokenizer, its encode() going through tokenizers' encode_batch for long texts:
    encode holds the GIL throughout (a 2.4 MB prompt: 2.5 s in which the event loop, though the
    tokenising ran in another thread, answered nobody), encode_batch releases it. Same ids."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _GIL_FREE_ENCODE_CHARS:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return self._tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


class AsyncLLM:
    def __init__(self, args: EngineArgs, core_addresses: list[str] | None = None, core_pids: list[int] | None = None,
                 server_index: int = 0) -> None:
        """core_addresses / core_pids: connect to the cores the launcher started (--api-server-count
        N); else start them. Only API server 0 counts the cores' own totals (preemptions, prefix-cache
        lookups) into the shared metrics, so that N servers do not count them N times."""
        self.args = args
        threads = media_loading_thread_count()
        template_limits()  # a bad MOE_CHAT_TEMPLATE_* variable fails the start, not every chat request
        self.info = resolve_model_info(args)
        self.input = InputProcessor(self.info)
        if self.info.tokenizer is not None:
            self.input.tokenizer = _GilReleasingTokenizer(self.info.tokenizer)
        self.metrics = EngineMetrics(args.model, self.info.max_model_len)
        self.input.metrics = self.metrics
        self.output = OutputProcessor(self.info.tokenizer, self.metrics, log_stats=not args.disable_log_stats,
                                      count_core_totals=server_index == 0)
        procs = [None] * len(core_addresses or [])
        if core_addresses is None:
            procs, core_addresses = launch_cores(args)
            core_pids = [p.pid for p in procs]
        self.clients = [CoreProcessClient(args, partial(self._on_result, i), partial(self._on_stats, i), self._on_dead,
                                          address, pid, proc)
                        for i, (address, pid, proc) in enumerate(zip(core_addresses, core_pids, procs))]
        if len(self.clients) == 1:  # one core: this process keeps only the keys of the images it holds
            self.input.ipc_sender = self.clients[0].ipc_cache
        self._core_stats = [SchedulerStats() for _ in self.clients]
        self._sent_since_stats = [0] * len(self.clients)
        self._core_of: dict[str, int] = {}  # request id -> the core running it
        self._queues: dict[str, asyncio.Queue] = {}
        self._counter = itertools.count()
        self.expert_load_meta: ExpertLoadMeta | None = None  # from the cores, at start
        self.expert_load_windows: deque[ExpertLoadWindow] = deque(maxlen=KEPT_WINDOWS)
        self._window_index = itertools.count()
        self._input_pool = ThreadPoolExecutor(threads, thread_name_prefix="moe-input")
        use_renderer_processes(threads)
        self._closed = False
        self.sleeping = 0  # sleep mode, as the cores last answered (control)

    async def run_input(self, fn: Callable[..., T], *args) -> T:
        """fn(*args) in the input thread pool (a request's input processing), off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._input_pool, fn, *args)

    async def start(self, timeout_s: float = 600.0) -> None:
        await asyncio.gather(*(c.start(timeout_s) for c in self.clients))
        a = self.args
        self.metrics.set_cache_config_info(  # as the offline engine's (llm_engine.py); blocks of one core
            block_size=a.block_size, enable_prefix_caching=a.enable_prefix_caching,
            gpu_memory_utilization=a.gpu_memory_utilization, num_gpu_blocks=self.clients[0].num_blocks,
            num_gpu_blocks_override=a.num_gpu_blocks_override)
        meta = self.clients[0].expert_load_meta
        if meta is not None:
            self.expert_load_meta = ExpertLoadMeta.from_json(meta)
            self.output.expert_load_layers = self.expert_load_meta.layers

    def expert_load_payload(self, since: int = 0) -> dict:
        """The live dashboard's data: the windows the cores sent (renumbered in arrival order:
        with -dp, several cores' windows interleave)."""
        if self.expert_load_meta is None:
            raise HTTPException(404, "this model records no expert load (no MoE layer, or record_expert_load off)")
        payload = windows_to_dashboard_json(self.expert_load_meta, list(self.expert_load_windows), since)
        if self.dead is not None:  # no window will come again: the page says "stopped", not "live"
            payload["stopped"] = {"why": f"engine core died ({self.dead})", "time": None}
        return payload

    def _keep_expert_windows(self, windows: list[dict]) -> None:
        for w in windows:
            w = dict(w, index=next(self._window_index))
            self.expert_load_windows.append(ExpertLoadWindow.from_json(w, self.expert_load_meta))

    @property
    def dead(self) -> str | None:
        return next((c.dead for c in self.clients if c.dead is not None), None)

    def _pick_core(self, num_seqs: int) -> int:
        loads = [s.num_running + s.num_waiting + sent for s, sent in zip(self._core_stats, self._sent_since_stats)]
        core = loads.index(min(loads))
        self._sent_since_stats[core] += num_seqs
        return core

    @property
    def stats(self) -> SchedulerStats:
        return self.output.stats

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._counter)}"

    async def generate(self, prompt: ProcessedPrompt, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas of the request until it finishes (the last one has finished=True)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.sleeping:
            raise HTTPException(503, f"the engine is asleep (level {self.sleeping}): POST /wake_up first")
        self.input.check_params(params)
        core_requests = self.input.make_core_requests(request_id, prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output.add_request(request_id, prompt, core_requests, arrival_time or time.monotonic())
        finished = False
        core = self._core_of[request_id] = self._pick_core(len(core_requests))
        try:
            self._add_to_core(core, core_requests)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)
            self._core_of.pop(request_id, None)

    def _add_to_core(self, core: int, core_requests: list) -> None:
        client = self.clients[core]
        ipc = client.ipc_cache if client.shm is None else client.shm.store  # hits: pixels the core can reach
        if ipc is None or not any(r.mm_items for r in core_requests):
            client.add_requests(core_requests)
            return
        if client.shm is None and self.input.ipc_sender is not None:  # nothing awaits from here to the send
            self.input.images.restore_evicted([m for r in core_requests for m in r.mm_items], client.ipc_cache)
        queries, hits = ipc.queries, ipc.hits
        client.add_requests(core_requests)
        self.metrics.mm_ipc_cache_queries.inc(ipc.queries - queries)
        self.metrics.mm_ipc_cache_hits.inc(ipc.hits - hits)

    def abort(self, request_id: str) -> None:
        ids = self.output.abort_request(request_id)
        core = self._core_of.get(request_id)
        if ids and core is not None:
            self.clients[core].abort(ids)

    def _aggregate_stats(self, core: int, stats: SchedulerStats) -> SchedulerStats:
        self._core_stats[core] = stats
        self._sent_since_stats[core] = 0
        if len(self._core_stats) == 1:
            return stats
        all_stats = self._core_stats
        return SchedulerStats(
            sum(s.num_running for s in all_stats), sum(s.num_waiting for s in all_stats),
            sum(s.kv_cache_usage for s in all_stats) / len(all_stats), sum(s.num_preemptions for s in all_stats),
            sum(s.prefix_cache_queries for s in all_stats), sum(s.prefix_cache_hits for s in all_stats))

    def _on_result(self, core: int, result: CoreStepResult) -> None:
        result.stats = self._aggregate_stats(core, result.stats)
        if result.expert_load_windows and self.expert_load_meta is not None:
            self._keep_expert_windows(result.expert_load_windows)
        processed = self.output.process(result)
        # A request's sequences all run on one core: the one that sent these outputs.
        self.clients[core].stop(processed.stopped)
        self.clients[core].abort(processed.aborted)
        for parent in processed.updated:
            queue = self._queues.get(parent.request_id)
            if queue is not None:
                delta = parent.delta_output()
                if delta.outputs or delta.finished:
                    queue.put_nowait(delta)

    def _on_stats(self, core: int, stats: SchedulerStats) -> None:
        self.output.update_stats(self._aggregate_stats(core, stats))

    def _on_dead(self, why: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(why))

    async def control(self, op: str, *args) -> int:
        """Sleep mode on every core (sleep [level], wake_up, is_sleeping): the level they sleep at (0
        awake), or a 400 naming why one refused."""
        replies = await asyncio.gather(*(c.control(op, *args) for c in self.clients))
        self.sleeping = max(r["sleeping"] for r in replies)
        errors = [r["error"] for r in replies if r["error"]]
        if errors:
            raise HTTPException(400, errors[0])
        return self.sleeping

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            # Renders in flight end at once (their renderer is killed), then their threads.
            stop_renderer_processes()
            self._input_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.gather(*(c.shutdown() for c in self.clients))
