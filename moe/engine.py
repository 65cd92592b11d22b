"""LLMEngine: input processing and validation, the schedule -> execute -> update loop, and
output processing (detokenisation, stop strings, logprobs, n>1 grouping, metrics)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from models.registry import load_model_config
from models.tiny import TINY_MODELS, ensure_tiny_model
from moe.config import EngineArgs
from moe.detokenizer import IncrementalDetokenizer
from moe.data_parallel import DataParallelScheduler
from moe.executor import Executor, make_executor
from moe.metrics import EngineMetrics, Metric
from moe.model_runner import TokenLogprobs
from moe.outputs import CompletionOutput, Logprob, RequestOutput
from moe.sampling_params import SamplingParams
from moe.tokenizer import Tokenizer, eos_token_ids, load_tokenizer
from scheduler import plan_groups, Request, RequestStatus, Scheduler, SchedulerConfig

logger = logging.getLogger("moe.engine")

_STATS_INTERVAL_S = 5.0


def resolve_model_path(model: str) -> str:
    return ensure_tiny_model(model) if model in TINY_MODELS else model


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass
class _Child:
    """One of the n sequences of a request, as the output side tracks it."""
    index: int
    detokenizer: IncrementalDetokenizer
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: ProcessedPrompt
    children: dict[str, _Child]
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())

    def to_output(self) -> RequestOutput:
        outs = [CompletionOutput(c.index, c.detokenizer.output_text, list(c.token_ids), c.cumulative_logprob,
                                 c.logprobs, c.finish_reason, c.stop_reason)
                for c in sorted(self.children.values(), key=lambda c: c.index)]
        return RequestOutput(self.request_id, self.prompt.prompt, self.prompt.prompt_token_ids, outs,
                             self.finished, num_cached_tokens=self.num_cached_tokens)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        self.model_path = resolve_model_path(args.model)
        model_cls, self.model_config = load_model_config(self.model_path)
        cfg = self.model_config
        self._validate_parallel(args, cfg, model_cls)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        cfg.limit_positions(self.max_model_len)
        self.device = args.resolve_device()
        self.dtype = args.resolve_dtype(cfg.torch_dtype)
        self.tokenizer: Tokenizer | None = load_tokenizer(args.tokenizer or self.model_path)
        if args.tokenizer is not None and self.tokenizer is None:
            raise OSError(f"no tokenizer.json found at tokenizer={args.tokenizer!r}")
        self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer, cfg.eos_token_ids)
        self.max_num_batched_tokens = args.max_num_batched_tokens or (
            8192 if args.enable_chunked_prefill else max(8192, self.max_model_len))

        # Every size check ran above: nothing has been started yet when one fails.
        self.executor: Executor = make_executor(model_cls, cfg, self.model_path, args, self.device,
                                                self.dtype, self.eos_token_ids)
        num_blocks = self.executor.determine_num_blocks(args.max_num_seqs, self.max_model_len,
                                                        self.max_num_batched_tokens)
        if num_blocks <= 0:
            raise ValueError("no memory is left for the KV cache after the weights and the activation peak; "
                             "increase gpu_memory_utilization (other processes' use of the GPU counts against "
                             "it), lower max_num_batched_tokens, or set num_gpu_blocks_override")
        tokens = num_blocks * args.block_size
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); maximum concurrency for %d tokens per "
                    "request: %.2fx", num_blocks, args.block_size, tokens, self.max_model_len,
                    tokens / self.max_model_len)
        # Chunked-local layers get a KV-cache group of their own, sized to what their chunks use.
        groups = plan_groups(cfg.kv_cache_chunk_sizes(), num_blocks, args.block_size, args.max_num_seqs,
                             self.max_num_batched_tokens)
        if len(groups) > 1:
            logger.info("KV cache groups: %s", ", ".join(
                f"{'full attention' if g.chunk_size is None else f'chunked-local {g.chunk_size}'}: "
                f"{g.num_blocks} blocks" for g in groups))
            if args.enable_prefix_caching:
                logger.info("Prefix caching is off: chunked-local layers release their blocks behind each chunk")
        # One scheduler (engine core) per data-parallel replica, each over its own KV cache.
        self.schedulers = [Scheduler(SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=args.block_size, num_blocks=num_blocks,
            enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_groups=groups))
            for _ in range(args.data_parallel_size)]
        self.scheduler = self.schedulers[0] if len(self.schedulers) == 1 else DataParallelScheduler(self.schedulers)
        self.executor.initialize_cache(groups)
        self.metrics = EngineMetrics(args.model)
        self._parents: dict[str, _Parent] = {}
        self.num_steps = 0
        self._shut_down = False
        self._child_to_parent: dict[str, str] = {}
        self._last_stats_log = time.monotonic()
        self._totals = {"preemptions": 0, "queries": 0, "hits": 0, "generation": 0}
        self._last_logged_generation = 0

    @staticmethod
    def _validate_parallel(args: EngineArgs, cfg, model_cls: type | None = None) -> None:
        """Every size must divide what it splits; raised before any process starts."""
        tp, pp, dp = args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size
        if pp > 1 and model_cls is not None and not getattr(model_cls, "supports_pp", False):
            raise ValueError(f"pipeline_parallel_size={pp}: {model_cls.__name__} does not support pipeline "
                             "parallelism yet (see moe/pipeline.py for how a model adopts it)")
        if cfg.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads="
                             f"{cfg.num_attention_heads}")
        if cfg.num_key_value_heads % tp and tp % cfg.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={cfg.num_key_value_heads} "
                             "must divide one another")
        if cfg.vocab_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide vocab_size={cfg.vocab_size}")
        if cfg.intermediate_size and cfg.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={cfg.intermediate_size}")
        if cfg.num_hidden_layers % pp:
            raise ValueError(f"pipeline_parallel_size={pp} does not divide num_hidden_layers={cfg.num_hidden_layers}")
        num_experts = next((getattr(cfg, n) for n in ("num_experts", "n_routed_experts", "num_local_experts")
                            if getattr(cfg, n, 0)), 0)
        if num_experts and args.enable_expert_parallel:
            if num_experts % (dp * tp):
                raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} (the expert-parallel size "
                                 f"with enable_expert_parallel) does not divide the {num_experts} experts")
        elif num_experts:
            moe_inter = getattr(cfg, "moe_intermediate_size", 0) or getattr(cfg, "intermediate_size_moe", 0)
            if moe_inter and moe_inter % tp:
                raise ValueError(f"tensor_parallel_size={tp} does not divide moe_intermediate_size={moe_inter} "
                                 "(experts are tensor-parallel without enable_expert_parallel)")

    # ---- inputs ------------------------------------------------------------------------
    def process_prompt(self, prompt) -> ProcessedPrompt:
        """A string, {"prompt": str} or {"prompt_token_ids": [...]} -> validated token ids."""
        text = None
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return self._check_tokens(ProcessedPrompt(prompt.get("prompt"), list(ids)))
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
        else:
            raise ValueError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                             f"got {type(prompt).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"a text prompt must be a string, got {type(text).__name__}")
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json: pass {'prompt_token_ids': [...]} "
                             "or tokenizer=<folder with tokenizer.json>")
        return self._check_tokens(ProcessedPrompt(text, self.tokenizer.encode(text)))

    def _check_tokens(self, p: ProcessedPrompt) -> ProcessedPrompt:
        ids, vocab = p.prompt_token_ids, self.model_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty (it has no tokens)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of vocabulary (vocab_size={vocab})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt (length {len(ids)}) is longer than the maximum model length "
                             f"max_model_len={self.max_model_len}")
        return p

    def add_request(self, request_id: str, prompt, params: SamplingParams,
                    processed: ProcessedPrompt | None = None) -> None:
        if self._shut_down:
            raise RuntimeError("this engine was shut down (LLM.shutdown): make a new LLM")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        p = processed or self.process_prompt(prompt)
        max_tokens = self.max_model_len - len(p.prompt_token_ids) if params.max_tokens is None else params.max_tokens
        max_tokens = max(max_tokens, 1)
        children = {}
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            child_params = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            children[child_id] = _Child(i, IncrementalDetokenizer(
                self.tokenizer if params.detokenize else None, p.prompt_token_ids, params.stop_list,
                params.include_stop_str_in_output, params.skip_special_tokens), child_params,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None)
        self._parents[request_id] = _Parent(request_id, p, children)
        for child_id, child in children.items():
            self._child_to_parent[child_id] = request_id
            self.scheduler.add_request(Request(
                child_id, p.prompt_token_ids, max_tokens, self.eos_token_ids, tuple(child.params.stop_token_ids),
                child.params.ignore_eos, child.params.min_tokens, child.params))

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            for child_id in parent.children:
                self._child_to_parent.pop(child_id, None)
            self.scheduler.finish_requests(list(parent.children), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._shut_down:
            raise RuntimeError("this engine was shut down (LLM.shutdown): make a new LLM")
        self.num_steps += 1
        if isinstance(self.scheduler, DataParallelScheduler):
            sos = self.scheduler.schedule()
            core_outputs = self.scheduler.update_from_output(sos, self.executor.execute_models(sos))
        else:
            so = self.scheduler.schedule()
            runner_out = self.executor.execute_model(so)
            core_outputs = self.scheduler.update_from_output(so, runner_out.sampled, runner_out.logprobs)
        self._count_step(core_outputs)
        finished: list[RequestOutput] = []
        for co in core_outputs:
            parent_id = self._child_to_parent.get(co.req_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            child = parent.children[co.req_id]
            if child.params.n == 1 or co.num_cached_tokens:
                parent.num_cached_tokens = max(parent.num_cached_tokens, co.num_cached_tokens)
            self._process_tokens(co, child, len(parent.prompt.prompt_token_ids))
            if child.finish_reason is not None:
                self._child_to_parent.pop(co.req_id, None)
                self.metrics.request_success.inc()
                if parent.finished:
                    finished.append(parent.to_output())
                    del self._parents[parent_id]
        self._maybe_log_stats()
        return finished

    def _process_tokens(self, co, child: _Child, num_prompt_tokens: int) -> None:
        if not child.token_ids:
            self.metrics.prompt_tokens.inc(num_prompt_tokens)
        child.token_ids.extend(co.new_token_ids)
        if co.new_logprobs and child.logprobs is not None:
            for entry in co.new_logprobs:
                child.logprobs.append(self._to_logprob_dict(entry))
                child.cumulative_logprob += entry.logprob
        # A stop token's own text is not part of the output (unless asked for).
        stopped_by_token = co.finish_reason == "stop" and not child.params.include_stop_str_in_output
        text_tokens = co.new_token_ids[:-1] if stopped_by_token else co.new_token_ids
        stop_str = child.detokenizer.update(text_tokens)
        if stop_str is None and co.finished:
            stop_str = child.detokenizer.flush()
        if stop_str is not None and not co.finished:
            self.scheduler.finish_requests(co.req_id, RequestStatus.FINISHED_STOPPED)
            child.finish_reason, child.stop_reason = "stop", stop_str
        elif stop_str is not None:
            child.finish_reason, child.stop_reason = "stop", stop_str
        elif co.finished:
            child.finish_reason, child.stop_reason = co.finish_reason, co.stop_reason

    def _to_logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.tokenizer.decode_token if self.tokenizer is not None else (lambda t: None)
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
        for rank, (tid, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
            if tid not in out:
                out[tid] = Logprob(lp, rank, decode(tid))
        return out

    # ---- metrics -----------------------------------------------------------------------
    def _count_step(self, core_outputs) -> None:
        m, s = self.metrics, self.scheduler
        generated = sum(len(co.new_token_ids) for co in core_outputs)
        m.generation_tokens.inc(generated)
        self._totals["generation"] += generated
        m.num_requests_running.set(s.num_running)
        m.num_requests_waiting.set(s.num_waiting)
        m.kv_cache_usage_perc.set(s.kv.usage())
        # The scheduler keeps running totals; the counters take the increments.
        for key, counter, total in (("preemptions", m.num_preemptions, s.num_preemptions),
                                    ("queries", m.prefix_cache_queries, s.kv.prefix_cache_queries),
                                    ("hits", m.prefix_cache_hits, s.kv.prefix_cache_hits)):
            counter.inc(total - self._totals[key])
            self._totals[key] = total

    def _maybe_log_stats(self) -> None:
        if self.args.disable_log_stats:
            return
        now = time.monotonic()
        elapsed = now - self._last_stats_log
        if elapsed < _STATS_INTERVAL_S:
            return
        s = self.scheduler
        gen = self._totals["generation"]
        queries = s.kv.prefix_cache_queries
        logger.info(
            "Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: "
            "%.1f%%, Prefix cache hit rate: %.1f%%, total_cumulative_preemption_cnt=%d",
            (gen - self._last_logged_generation) / elapsed, s.num_running, s.num_waiting, 100 * s.kv.usage(),
            100 * s.kv.prefix_cache_hits / queries if queries else 0.0, s.num_preemptions)
        self._last_logged_generation = gen
        self._last_stats_log = now

    def get_metrics(self) -> list[Metric]:
        return self.metrics.snapshot()

    def shutdown(self) -> None:
        """Stop the workers and release the model and the KV cache (GPU memory included)."""
        self._shut_down = True
        self.executor.shutdown()
