"""EngineCore: the scheduler(s) and the executor, and nothing else: schedule -> execute -> update.

It sees only token ids: one `CoreRequest` per sequence (the input side fans a request with n > 1
out into n of them), and it returns per step the new tokens of each sequence, raw logprobs,
finish states and the scheduler's statistics (`CoreStepResult`). Text, stop strings and the
grouping of sequences into requests are the output side's (moe/engine/output_processor.py).

The offline `LLMEngine` calls it directly in its own process; `moe serve` runs it in a process of
its own behind ZeroMQ (moe/engine/core_process.py).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from moe.engine.data_parallel import DataParallelScheduler
from moe.engine.eplb_driver import EplbDriver
from moe.engine.model_info import ModelInfo
from moe.engine.routed_experts import RoutedExpertsTracker
from moe.engine.step_recovery import StepRecovery
from moe.expert_load.recording import ExpertLoadMeta
from moe.expert_load.tracker import ExpertLoadTracker, physical_slot_ranks
from moe.gc_freeze import freeze_startup_heap, release_frozen_heap
from moe.sampling_params import SamplingParams
from moe.structured_output.manager import StructuredOutputManager
from moe.worker.executor import Executor, InProcessExecutor, make_executor
from moe.worker.model_runner import ModelRunnerOutput, PendingStep
from routing.placement import expert_owner_ranks
from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig, SchedulerOutput, plan_groups
from scheduler.kv_cache_spec import KVCacheGroup, SlidingWindow
from scheduler.output import EngineCoreOutput

logger = logging.getLogger("moe.engine.llm_engine")


def _group_name(g: KVCacheGroup) -> str:
    if g.recurrent:
        return "recurrent state (slots)"
    if g.sliding_window is not None:
        return f"sliding window {g.sliding_window}"
    return "full attention" if g.chunk_size is None else f"chunked-local {g.chunk_size}"


@dataclass
class CoreRequest:
    """One sequence to generate, as the engine core receives it."""
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    mm_items: list = field(default_factory=list)  # the prompt's images (moe/multimodal/inputs.py's ImageItem)


@dataclass
class SchedulerStats:
    """The scheduler's state after a step; the totals only grow."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class CoreStepResult:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    # Seconds from arrival to first scheduling, for the requests scheduled for the first time.
    queue_times: dict[str, float] = field(default_factory=dict)
    # Why a failed step finished a request with finish_reason "error".
    errors: dict[str, str] = field(default_factory=dict)
    # Expert-load windows closed after this step (ExpertLoadWindow.to_json()), for metrics and the dashboard.
    expert_load_windows: list[dict] = field(default_factory=list)


class EngineCore:
    def __init__(self, info: ModelInfo) -> None:
        args = info.args
        self.info = info
        self.max_model_len = info.max_model_len
        self.device = info.device
        # Every size check ran in resolve_model_info: nothing has been started yet when one fails.
        self.executor: Executor = make_executor(info.model_cls, info.model_config, info.model_path, args,
                                                info.device, info.dtype, info.eos_token_ids)
        num_blocks = self.executor.determine_num_blocks(args.max_num_seqs, self.max_model_len,
                                                        info.max_num_batched_tokens)
        self._check_kv_cache_size(num_blocks)
        tokens = num_blocks * args.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency for %d tokens per "
                    "request: %.2fx", num_blocks, args.block_size, tokens, self.max_model_len,
                    tokens / self.max_model_len)
        # Local layers get a KV-cache group of their own, sized to what their windows use (prefix
        # caching spans the groups: scheduler/kv_cache_manager.py); where no layer attends fully,
        # sliding-window layers read through a full-attention group 0.
        keys = info.model_config.kv_cache_keys()
        if None not in keys:
            keys = [None if isinstance(k, SlidingWindow) else k for k in keys]
        groups = plan_groups(keys, num_blocks, args.block_size, args.max_num_seqs, info.max_num_batched_tokens)
        if len(groups) > 1:
            logger.info("KV cache groups: %s", ", ".join(f"{_group_name(g)}: {g.num_blocks} blocks" for g in groups))
            if args.enable_prefix_caching and any(g.recurrent for g in groups):
                logger.info("Prefix caching is off: recurrent (linear-attention) layers keep one state per request, "
                            "not the state at each cached prefix's end")
        # Async scheduling needs an executor that can queue a step before the last one's tokens are
        # back (in this process: the runner keeps them on the device; worker processes of one TP
        # replica: its ranks pass them among themselves) and one scheduler; images keep synchronous
        # steps. The default (None) takes it for a single-process engine on CUDA (on the CPU the
        # step itself blocks the host, so there is nothing to overlap); worker processes only when
        # asked for (not yet measured on GPUs).
        supported = self.executor.supports_async_steps and args.data_parallel_size == 1 and not info.image_limit
        in_process = isinstance(self.executor, InProcessExecutor)
        wanted = (self.device.type == "cuda" and in_process) if args.async_scheduling is None \
            else args.async_scheduling
        self.async_scheduling = bool(wanted and supported)
        if args.async_scheduling and not supported:
            logger.warning("async_scheduling needs one data-parallel replica of one pipeline stage and a text model; "
                           "steps run synchronously")
        # One scheduler per data-parallel replica, each over its own KV cache.
        self.schedulers = [Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=info.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=args.block_size, num_blocks=num_blocks,
            enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_groups=groups, encoder_cache_size=self._encoder_cache_size(info),
            async_scheduling=self.async_scheduling,
            defer_grammar_masks=self.async_scheduling and self.executor.supports_deferred_sampling))
            for _ in range(args.data_parallel_size)]
        self.scheduler = self.schedulers[0] if len(self.schedulers) == 1 else DataParallelScheduler(self.schedulers)
        self.executor.initialize_cache(groups)
        # Failed steps are undone and isolated where the executor can go on after one (in-process);
        # a failed worker process closes a multi-process executor, which then reports that.
        self.recovery = StepRecovery(self.scheduler) \
            if isinstance(self.executor, InProcessExecutor) and isinstance(self.scheduler, Scheduler) else None
        self.num_steps = 0
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None  # async scheduling
        self._arrival: dict[str, float] = {}  # requests not scheduled yet -> arrival time
        # Requests added with penalties (async scheduling finishes the step in flight before their steps).
        self._history_ids: set[str] = set()
        self.structured: StructuredOutputManager | None = None  # made at the first structured request
        self.expert_load, self.eplb = self._start_expert_load(info)
        self.routed = RoutedExpertsTracker(self.schedulers) if args.enable_return_routed_experts else None
        self.sleeping = 0  # sleep mode: the level (0 awake)
        freeze_startup_heap()  # no full garbage collection walks the start-up heap mid-serving

    @staticmethod
    def _encoder_cache_size(info: ModelInfo) -> int:
        """Image embeddings the runner may hold at once (vLLM's rule: the step's token budget, and
        at least one largest image); 0 without images."""
        if not info.image_limit:
            return 0
        return max(info.max_num_batched_tokens, info.max_image_embeds)

    def _start_expert_load(self, info: ModelInfo) -> tuple[ExpertLoadTracker | None, EplbDriver | None]:
        """The expert-load windows over every rank's counters (None without MoE layers or with
        record_expert_load=False), and EPLB when asked for."""
        args = info.args
        if not (args.record_expert_load or args.enable_eplb):
            return None, None
        snap = self.executor.expert_load_snapshot()  # start-up forwards are in it: the baseline
        if snap is None:
            return None, None
        E, P = snap["logical"].shape[1], snap["physical"].shape[1]
        ep = args.tensor_parallel_size * args.data_parallel_size if args.enable_expert_parallel else 1
        if ep == 1:
            slot_rank = np.zeros(P, dtype=np.int64)
        else:
            owner = None if args.enable_eplb else expert_owner_ranks(E, ep, args.expert_placement_strategy).numpy()
            slot_rank = physical_slot_ranks(P, ep, owner)
        meta = ExpertLoadMeta(model=args.model, layers=snap["layers"], num_experts=E, ep_size=ep,
                              num_physical_experts=P, window_steps=args.expert_load_window_steps)
        tracker = ExpertLoadTracker(meta, slot_rank, snap, self.num_steps)
        eplb = None
        if args.enable_eplb:
            groups = getattr(info.model_config, "n_group", None) or 1  # DeepSeek's expert groups
            eplb = EplbDriver(args.eplb, tracker, self.executor, num_groups=groups)
        return tracker, eplb

    def fold_expert_load(self) -> dict | None:
        """Close an expert-load window over the steps since the last one (its JSON, or None)."""
        if self.expert_load is None:
            return None
        window = self.expert_load.fold(self.executor.expert_load_snapshot(), self.num_steps)
        if window is None:
            return None
        eplb = self.info.args.eplb
        if eplb is not None and eplb.log_balancedness:
            logger.info("EPLB: balancedness %.4f over steps %d..%d (mean over %d MoE layers)",
                        float(window.balancedness.mean()), window.step_start, window.step_end,
                        len(window.balancedness))
        return window.to_json()

    def rebalance_experts(self) -> None:
        """EPLB now, from the load of the last window_size steps (between steps)."""
        if self.eplb is None:
            raise RuntimeError("rebalance_experts needs enable_eplb=True")
        self.fold_expert_load()
        self.eplb.rebalance(self.num_steps)

    def _after_step(self, result: CoreStepResult) -> None:
        if self.routed is not None:
            self.routed.forget_finished()
        tracker = self.expert_load
        if tracker is None:
            return
        due_rebalance = self.eplb is not None and self.eplb.due(self.num_steps)
        if self.num_steps % tracker.meta.window_steps == 0 or due_rebalance:
            window = self.fold_expert_load()
            if window is not None:
                result.expert_load_windows.append(window)
        if due_rebalance:
            self.eplb.rebalance(self.num_steps)

    def _check_kv_cache_size(self, num_blocks: int) -> None:
        """Enough KV blocks for one request of max_model_len, with advice for the device in use."""
        args = self.info.args
        if args.num_gpu_blocks_override is not None:
            knobs = "raise num_gpu_blocks_override"
        elif self.device.type == "cpu":
            size = args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None else "1 GiB by default"
            knobs = (f"on the CPU the KV cache is sized by kv_cache_memory_bytes (now {size}): raise it, "
                     "or set num_gpu_blocks_override")
        elif args.kv_cache_memory_bytes is not None:
            knobs = f"raise kv_cache_memory_bytes (now {args.kv_cache_memory_bytes}) or set num_gpu_blocks_override"
        else:
            knobs = ("increase gpu_memory_utilization (other processes' use of the GPU counts against it), lower "
                     "max_num_batched_tokens, or set kv_cache_memory_bytes / num_gpu_blocks_override")
        if num_blocks <= 0:
            raise ValueError(f"no memory is left for the KV cache (0 blocks) on {self.device.type}: {knobs}")
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(f"the KV cache on {self.device.type} holds {num_blocks} blocks x {args.block_size} "
                             f"tokens = {num_blocks * args.block_size} tokens, fewer than max_model_len="
                             f"{self.max_model_len}, so a request of that length could never run; {knobs}, "
                             "or lower max_model_len")

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, req: CoreRequest) -> None:
        if self.sleeping:
            raise RuntimeError(f"the engine is asleep (level {self.sleeping}): call wake_up() before adding requests")
        p = req.params
        request = Request(
            req.request_id, req.prompt_token_ids, req.max_tokens, req.eos_token_ids, tuple(p.stop_token_ids),
            p.ignore_eos, p.min_tokens, p, mm_items=req.mm_items,
            skip_reading_prefix_cache=p.prompt_logprobs is not None,
            use_structured_output=p.structured_outputs is not None)
        if request.use_structured_output:
            manager = self._structured_outputs()
            if req.request_id in manager:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            manager.add_request(request)  # before the scheduler: it may have to wait for its grammar
            try:
                self.scheduler.add_request(request)
            except Exception:
                manager.remove([req.request_id])
                raise
        else:
            self.scheduler.add_request(request)
        self._arrival[req.request_id] = time.monotonic()
        if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
            self._history_ids.add(req.request_id)

    def _structured_outputs(self) -> StructuredOutputManager:
        if self.structured is None:
            info = self.info
            if info.tokenizer is None:
                raise ValueError("structured_outputs need the model's tokenizer (tokenizer.json), and this model "
                                 "has none")
            self.structured = StructuredOutputManager(info.tokenizer, info.model_config.vocab_size,
                                                      tuple(info.eos_token_ids), info.args.structured_outputs)
        return self.structured

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Finish sequences now (aborted, or stopped by a stop string); unknown ids are ignored."""
        self._finish(request_ids, status)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Nothing the step in flight computes is wanted any more: collect it now (its outputs
            # are dropped), so the engine is idle, as after a synchronous step.
            self._finish_in_flight(CoreStepResult())

    def _finish(self, request_ids: list[str], status: RequestStatus) -> None:
        if self.recovery is not None:
            self.recovery.forget(request_ids)
        for rid in request_ids:
            self._arrival.pop(rid, None)
        if self.structured is not None:
            self.structured.remove(request_ids)
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.recovery and self.recovery.num_held) \
            or self._in_flight is not None

    @property
    def load(self) -> int:
        """Waiting + running sequences: what a router balances on."""
        return self.scheduler.num_waiting + self.scheduler.num_running

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> CoreStepResult:
        self.num_steps += 1
        result = CoreStepResult()
        if self.structured is not None:
            self._poll_grammars(result)
        if self.async_scheduling:
            self._step_async(result)
        elif isinstance(self.scheduler, DataParallelScheduler):
            sos = self._schedule()
            self._note_scheduled(sos, result)
            outs = self.executor.execute_models(sos)
            if self.routed is not None:
                for replica, (so, out) in enumerate(zip(sos, outs)):
                    self.routed.record(replica, so, out.routed_experts)
            outputs = self.scheduler.update_from_output(sos, outs)
            if self.routed is not None:
                self.routed.attach(outputs)
            result.outputs.extend(self._advance_grammars(outputs, result))
        else:
            so = self._schedule()
            self._note_scheduled([so], result)
            try:
                runner_out = self.executor.execute_model(so)
            except Exception as exc:
                self._recover_from_failed_step(so, exc, result)
                result.stats = self.stats()
                return result
            if self.recovery is not None:
                self.recovery.on_success(so)
            result.outputs.extend(self._advance_grammars(self._apply_output(so, runner_out), result))
        if self.recovery is not None:
            finished = [co.req_id for co in result.outputs if co.finish_reason is not None]
            if finished:
                self.recovery.forget(finished)
        self._after_step(result)
        result.stats = self.stats()
        return result

    def _step_async(self, result: CoreStepResult) -> None:
        """Schedule and launch this step, then wait for the previous one's tokens and apply them:
        the host's scheduling, input building and output handling overlap the GPU's work. The
        scheduler gives each sampling request of the step in flight a placeholder token, which this
        step computes with its value copied on the device (ModelRunner.launch / collect). Requests
        whose sampling needs their full token history (penalties) wait for the step in flight."""
        executor = self.executor
        if self._in_flight is not None and self._needs_history():
            self._finish_in_flight(result)
        so = self._schedule()
        self._note_scheduled([so], result)
        prev = self._in_flight
        self._in_flight = None
        try:
            pending = executor.launch(so, prev=prev[1] if prev else None)
        except Exception as exc:
            if prev is not None:
                self._in_flight = prev
                self._finish_in_flight(result)
            self._recover_from_failed_step(so, exc, result)
            return
        if pending is not None:
            self._in_flight = (so, pending)
        else:  # nothing samples in this step: it is done with its launch (the next step is ordered after it)
            self._apply(so, None, result)
        if prev is not None:
            try:
                out = executor.collect(prev[1])
            except Exception as exc:
                if self._in_flight is not None and self.recovery is not None:
                    self.recovery.rollback(self._in_flight[0])  # queued behind the failed step
                self._in_flight = None
                self._recover_from_failed_step(prev[0], exc, result)
                return
            self._apply(prev[0], out, result)
        if self._in_flight is not None and so.deferred_grammar_ids:
            # The step's structured rows whose token was in flight: their matchers have consumed it
            # now, so their masks complete the bitmask and the step samples (queued behind its forward).
            self.structured.fill_deferred(so)
            self._in_flight = (so, executor.sample_deferred(pending, so))

    def _finish_in_flight(self, result: CoreStepResult) -> None:
        so, pending = self._in_flight
        self._in_flight = None
        if so.deferred_grammar_ids:  # launched without its sampling (not normally left so: _step_async samples it)
            self.structured.fill_deferred(so)
            pending = self.executor.sample_deferred(pending, so)
        self._apply(so, self.executor.collect(pending), result)

    def _apply(self, so: SchedulerOutput, out: ModelRunnerOutput | None, result: CoreStepResult) -> None:
        if self.recovery is not None:
            self.recovery.on_success(so)
        if out is not None:
            result.outputs.extend(self._advance_grammars(self._apply_output(so, out), result))

    def _apply_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """One replica's step output applied: the scheduler's outputs, with prompt logprobs and the
        routed experts (filed before the scheduler frees the finished requests' blocks)."""
        if self.routed is not None:
            self.routed.record(0, so, out.routed_experts)
        outputs = out.attach_prompt_logprobs(self.scheduler.update_from_output(so, out.sampled, out.logprobs))
        if self.routed is not None:
            self.routed.attach(outputs)
        return outputs

    # ---- structured outputs ------------------------------------------------------------
    def _schedule(self):
        """The scheduler's step (one SchedulerOutput, or a list under data parallelism), with the
        grammar bitmask of its structured sequences that sample (filled on the host, here)."""
        sos = self.scheduler.schedule()
        if self.structured is not None:
            for so in sos if isinstance(sos, list) else [sos]:
                self.structured.fill_bitmask(so)
        return sos

    def _poll_grammars(self, result: CoreStepResult) -> None:
        """Let the sequences whose grammar compiled be scheduled; finish those whose grammar failed.
        When nothing else can run, wait a little for a compilation rather than spin."""
        s = self.scheduler
        idle = self._in_flight is None and s.num_running == 0 and s.num_waiting <= self.structured.num_compiling
        errors = self.structured.poll(block=idle)
        if errors:
            self._finish(list(errors), RequestStatus.FINISHED_ABORTED)
            for rid, error in errors.items():
                result.outputs.append(EngineCoreOutput(rid, [], finish_reason="error"))
                result.errors[rid] = error

    def _advance_grammars(self, outputs: list[EngineCoreOutput], result: CoreStepResult) -> list[EngineCoreOutput]:
        """The matchers consume the step's tokens: a grammar that is complete finishes its sequence
        ("stop", as EOS would), a refused token (the mask prevents it) finishes it with an error."""
        if self.structured is None:
            return outputs
        stopped, errors = self.structured.advance(outputs)
        if stopped or errors:
            by_id = {co.req_id: co for co in outputs}
            self._finish(stopped, RequestStatus.FINISHED_STOPPED)
            for rid in stopped:
                co = by_id[rid]
                co.finish_reason, co.stop_reason, co.stopped_by_grammar = "stop", None, True
            self._finish(list(errors), RequestStatus.FINISHED_ABORTED)
            for rid, error in errors.items():
                logger.error("request %s: %s", rid, error)
                by_id[rid].finish_reason = "error"
                result.errors[rid] = error
        return outputs

    def _needs_history(self) -> bool:
        """A running request samples with penalties (they count its generated tokens). Looks at the
        requests added with penalties (none in the common case), not at every running one."""
        ids = self._history_ids
        if not ids:
            return False
        requests = self.scheduler.requests
        ids.intersection_update(requests)  # those finished since are gone
        return any(requests[rid].status == RequestStatus.RUNNING for rid in ids)

    def _note_scheduled(self, sos, result: CoreStepResult) -> None:
        if not self._arrival:
            return
        now = time.monotonic()
        for so in sos:
            for new in so.scheduled_new_reqs:
                arrival = self._arrival.pop(new.req_id, None)
                if arrival is not None:
                    result.queue_times[new.req_id] = now - arrival

    def _recover_from_failed_step(self, so, exc: Exception, result: CoreStepResult) -> None:
        """Undo the failed step and finish the sequences it can be blamed on with an error; the
        others go on (moe/engine/step_recovery.py). Re-raised when the executor cannot go on."""
        if self.recovery is None or not so.num_scheduled_tokens:
            raise exc
        culprits = self.recovery.on_failure(so, exc)
        error = f"{type(exc).__name__}: {exc}"
        logger.error("a step of %d request(s) failed (%s); %s", len(so.num_scheduled_tokens), error,
                     f"finishing request(s) {culprits} with an error" if culprits else
                     "running the suspects one at a time to find the cause", exc_info=exc)
        if culprits:
            self.abort_requests(list(culprits))
        for rid in culprits:
            result.outputs.append(EngineCoreOutput(rid, [], finish_reason="error"))
            result.errors[rid] = error

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(s.num_running, s.num_waiting, s.kv.usage(), s.num_preemptions,
                              s.kv.prefix_cache_queries, s.kv.prefix_cache_hits)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache() is not False

    # ---- weight updates and sleep mode (RL rollouts) ----------------------------------------
    def _require_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            n = sum(s.num_running + s.num_waiting for s in self.schedulers)
            raise RuntimeError(f"{what} needs an idle engine, and {n} request(s) are unfinished: let them finish "
                               "or abort them first")

    def update_weights(self, named_tensors) -> int:
        """New weights in place (Hugging Face names), on every rank; the prefix cache is dropped, its
        blocks having been computed with the old ones. Returns the tensor pieces taken over all ranks."""
        if self.sleeping:
            raise RuntimeError("update_weights while the engine sleeps: call wake_up() first")
        self._require_idle("update_weights")
        taken = self.executor.update_weights(list(named_tensors))
        for s in self.schedulers:
            s.kv.reset_prefix_cache()
        return taken

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (and CUDA graphs); level 1 keeps the weights in host memory, level 2 drops
        them (after wake_up, load them with update_weights)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleeping:
            raise RuntimeError(f"the engine is already asleep (level {self.sleeping})")
        self._require_idle("sleep")
        for s in self.schedulers:
            s.kv.reset_prefix_cache()
        self.executor.sleep(level)
        self.sleeping = level

    def wake_up(self) -> None:
        if not self.sleeping:
            raise RuntimeError("wake_up: the engine is not asleep")
        self.executor.wake_up()
        self.sleeping = 0

    def shutdown(self) -> None:
        """Stop the workers and release the model and the KV cache (GPU memory included)."""
        if getattr(self, "_in_flight", None) is not None:  # outputs not wanted; workers reply before they stop
            with contextlib.suppress(Exception):
                self._finish_in_flight(CoreStepResult())
        if getattr(self, "structured", None) is not None:
            self.structured.shutdown()
        release_frozen_heap()  # this engine's reference cycles become collectable
        self.executor.shutdown()
