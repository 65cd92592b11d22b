"""LLMEngine: the offline engine, the three parts of the engine in the caller's process.

    InputProcessor (moe/engine/input_processor.py): prompts -> validated token ids -> CoreRequests
    EngineCore     (moe/engine/core.py):     schedule -> execute -> update, token ids only
    OutputProcessor (moe/engine/output_processor.py): tokens -> text, stop strings, logprobs, metrics

Here they call one another directly (no sockets, no encoding); `moe serve` puts the engine core
in a process of its own (moe/engine/core_process.py) and the two others in the API process.
"""
from __future__ import annotations

import logging

from moe.config import EngineArgs
from moe.engine.core import EngineCore
from moe.engine.input_processor import InputProcessor, ProcessedPrompt
from moe.engine.metrics import EngineMetrics, Metric
from moe.engine.model_info import resolve_model_info
from moe.engine.output_processor import STATS_INTERVAL_S, OutputProcessor, ProcessResult
from moe.outputs import RequestOutput
from moe.sampling_params import SamplingParams
from moe.worker.parallel_executor import exit_if_reimported_by_spawn
from scheduler import RequestStatus

logger = logging.getLogger("moe.engine.llm_engine")

_STATS_INTERVAL_S = STATS_INTERVAL_S  # how often the stats line is logged (disable_log_stats=False)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        exit_if_reimported_by_spawn()
        self.args = args
        self.info = resolve_model_info(args)
        self.input = InputProcessor(self.info)
        self.core = EngineCore(self.info)
        self.metrics = EngineMetrics(args.model, self.info.max_model_len)
        self.metrics.set_cache_config_info(
            block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization, num_gpu_blocks=self.core.scheduler.kv.num_blocks,
            num_gpu_blocks_override=args.num_gpu_blocks_override)
        self.input.metrics = self.metrics
        # The latency histograms are filled whether or not the stats line is logged (get_metrics reads them).
        self.output = OutputProcessor(self.info.tokenizer, self.metrics, log_stats=not args.disable_log_stats,
                                      stats_interval_s=_STATS_INTERVAL_S)
        if self.core.expert_load is not None:
            self.output.expert_load_layers = self.core.expert_load.meta.layers
        self._shut_down = False

    # What callers and tests read of the model and the core.
    model_config = property(lambda self: self.info.model_config)
    model_path = property(lambda self: self.info.model_path)
    max_model_len = property(lambda self: self.info.max_model_len)
    max_num_batched_tokens = property(lambda self: self.info.max_num_batched_tokens)
    tokenizer = property(lambda self: self.info.tokenizer)
    eos_token_ids = property(lambda self: self.info.eos_token_ids,
                             lambda self, ids: setattr(self.info, "eos_token_ids", tuple(ids)))
    device = property(lambda self: self.info.device)
    dtype = property(lambda self: self.info.dtype)
    max_logprobs = property(lambda self: self.input.max_logprobs,
                            lambda self, n: setattr(self.input, "max_logprobs", n))
    executor = property(lambda self: self.core.executor)
    scheduler = property(lambda self: self.core.scheduler)
    schedulers = property(lambda self: self.core.schedulers)
    recovery = property(lambda self: self.core.recovery)
    num_steps = property(lambda self: self.core.num_steps)
    _parents = property(lambda self: self.output.parents)
    _child_to_parent = property(lambda self: self.output.child_to_parent)

    @property
    def _warned_max_tokens_cap(self) -> bool:
        return self.input._warned_max_tokens_cap

    @_warned_max_tokens_cap.setter
    def _warned_max_tokens_cap(self, value: bool) -> None:
        self.input._warned_max_tokens_cap = value

    # ---- inputs ------------------------------------------------------------------------
    def get_tokenizer(self):
        """The tokenizer (encode / decode), or None for a model folder without tokenizer.json."""
        return self.info.tokenizer

    def process_prompt(self, prompt, params: SamplingParams | None = None) -> ProcessedPrompt:
        """The prompt's validated token ids, cut to params.truncate_prompt_tokens first."""
        return self.input.process_prompt(prompt, params.truncate_prompt_tokens if params is not None else None)

    def truncate_prompt(self, p: ProcessedPrompt, params: SamplingParams | None) -> ProcessedPrompt:
        """An already processed prompt (LLM.chat's) cut to params.truncate_prompt_tokens."""
        return self.input.truncate(p, params.truncate_prompt_tokens if params is not None else None)

    def check_params(self, params: SamplingParams) -> None:
        self.input.check_params(params)

    def add_request(self, request_id: str, prompt, params: SamplingParams,
                    processed: ProcessedPrompt | None = None) -> None:
        if self._shut_down:
            raise RuntimeError("this engine was shut down (LLM.shutdown): make a new LLM")
        self.check_params(params)
        if self.output.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        p = self.truncate_prompt(processed, params) if processed else self.process_prompt(prompt, params)
        core_requests = self.input.make_core_requests(request_id, p, params)
        self.output.add_request(request_id, p, core_requests)
        for cr in core_requests:
            self.core.add_request(cr)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Abort requests by id; the id of one sequence of an n > 1 request aborts the whole
        request. Unknown ids (e.g. requests that already finished) are ignored, as in vLLM."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        try:
            ids = None if isinstance(ids, (bytes, bytearray)) else list(ids)
        except TypeError:  # not iterable: None, a number
            ids = None
        if ids is None or not all(isinstance(i, str) for i in ids):
            raise TypeError(f"request_id must be a request id (a string) or a list of them, got {request_id!r:.100}")
        for rid in ids:
            child_ids = self.output.abort_request(rid)
            if child_ids:
                self.core.abort_requests(child_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------------
    def step_detailed(self) -> ProcessResult:
        """One core step through the output side; what a stop string ended is finished in the core."""
        if self._shut_down:
            raise RuntimeError("this engine was shut down (LLM.shutdown): make a new LLM")
        result = self.output.process(self.core.step())
        if result.stopped:
            self.core.abort_requests(result.stopped, RequestStatus.FINISHED_STOPPED)
        if result.aborted:
            self.core.abort_requests(result.aborted)
        return result

    def step(self) -> list[RequestOutput]:
        """One step; returns the requests it finished."""
        return [p.to_output() for p in self.step_detailed().finished]

    def get_metrics(self) -> list[Metric]:
        return self.metrics.snapshot()

    def shutdown(self) -> None:
        """Stop the workers and release the model and the KV cache (GPU memory included)."""
        self._shut_down = True
        self.core.shutdown()
