"""AsyncLLM: the engine as an API process sees it. Input processing and output processing run
here (in the event loop's thread); the engine core runs in its own process (moe/core_client.py).

`generate()` is an async iterator of per-step deltas of one request; leaving it early (a client
that disconnected, a cancelled task) aborts the request in the core, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import AsyncIterator

from moe.config import EngineArgs
from moe.core_client import CoreProcessClient, EngineDeadError
from moe.engine_core import CoreStepResult, SchedulerStats
from moe.input_processor import InputProcessor, ProcessedPrompt
from moe.metrics import EngineMetrics
from moe.model_info import resolve_model_info
from moe.output_processor import OutputProcessor
from moe.outputs import RequestOutput
from moe.sampling_params import SamplingParams

logger = logging.getLogger("moe.serve")


class AsyncLLM:
    def __init__(self, args: EngineArgs, core_address: str | None = None, core_pid: int | None = None,
                 server_index: int = 0) -> None:
        """core_address / core_pid: connect to a core the launcher started (--api-server-count N);
        else start one. Only API server 0 counts the core's own totals (preemptions, prefix-cache
        lookups) into the shared metrics, so that N servers do not count them N times."""
        self.args = args
        self.info = resolve_model_info(args)
        self.input = InputProcessor(self.info)
        self.metrics = EngineMetrics(args.model)
        self.output = OutputProcessor(self.info.tokenizer, self.metrics, log_stats=not args.disable_log_stats,
                                      count_core_totals=server_index == 0)
        self.client = CoreProcessClient(args, self._on_result, self._on_stats, self._on_dead, core_address, core_pid)
        self._queues: dict[str, asyncio.Queue] = {}
        self._counter = itertools.count()

    async def start(self, timeout_s: float = 600.0) -> None:
        await self.client.start(timeout_s)

    @property
    def dead(self) -> str | None:
        return self.client.dead

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
        self.input.check_params(params)
        core_requests = self.input.make_core_requests(request_id, prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output.add_request(request_id, prompt, core_requests, arrival_time or time.monotonic())
        finished = False
        try:
            self.client.add_requests(core_requests)
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

    def abort(self, request_id: str) -> None:
        ids = self.output.abort_request(request_id)
        if ids:
            self.client.abort(ids)

    def _on_result(self, result: CoreStepResult) -> None:
        processed = self.output.process(result)
        self.client.stop(processed.stopped)
        self.client.abort(processed.aborted)
        for parent in processed.updated:
            queue = self._queues.get(parent.request_id)
            if queue is not None:
                delta = parent.delta_output()
                if delta.outputs or delta.finished:
                    queue.put_nowait(delta)

    def _on_stats(self, stats: SchedulerStats) -> None:
        self.output.update_stats(stats)

    def _on_dead(self, why: str) -> None:
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(why))

    async def shutdown(self) -> None:
        await self.client.shutdown()
