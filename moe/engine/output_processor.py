"""Output processing: the engine core's per-sequence tokens -> request outputs.

Detokenisation, stop strings, logprob decoding (prompt logprobs too), the grouping of the n
sequences of a request, and the metrics (token counts, the scheduler's gauges and counters,
request_success by finished_reason, the per-request and latency histograms:
moe/engine/metrics.py). Runs in the
caller's process offline and in the API process(es) under `moe serve`. A stop string found here
finishes its sequence in the core: the caller does that with `ProcessResult.stopped` (directly
offline, as a message when served).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from moe.engine.core import CoreRequest, CoreStepResult, SchedulerStats
from moe.engine.detokenizer import IncrementalDetokenizer
from moe.engine.input_processor import ProcessedPrompt
from moe.engine.metrics import EngineMetrics, FinishedRequestStats, observe_repeated
from moe.engine.routed_experts import RoutedRows
from moe.engine.tokenizer import Tokenizer
from moe.outputs import CompletionOutput, Logprob, RequestOutput
from moe.sampling_params import SamplingParams
from moe.worker.model_runner import TokenLogprobs
from moe.worker.prompt_logprobs import PromptLogprobs

logger = logging.getLogger("moe.engine.llm_engine")

STATS_INTERVAL_S = 5.0


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
    max_tokens: int | None = None
    # Metrics (time.monotonic(); with record_latencies): first scheduling (estimated from the core's
    # queue time), the first and the last token.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Streaming: how much of the text / tokens earlier deltas handed out, and whether the finish did.
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False
    # enable_return_routed_experts: the rows the core sent so far, and the finished sequence's array.
    routed: RoutedRows | None = None
    routed_experts: Any = None

    def delta(self) -> CompletionOutput | None:
        """What is new since the last delta (None if nothing). Unfinished, the last characters a
        stop string could still cut away are held back."""
        finished = self.finish_reason is not None
        text = self.detokenizer.output_text
        end = len(text) if finished or not self.params.stop_list else max(
            self.sent_chars, len(text) - self.detokenizer.stop_buffer)
        tokens = self.token_ids[self.sent_tokens:]
        if end == self.sent_chars and not tokens and (not finished or self.sent_finish):
            return None
        out = CompletionOutput(self.index, text[self.sent_chars:end], tokens, self.cumulative_logprob,
                               None if self.logprobs is None else self.logprobs[self.sent_tokens:],
                               self.finish_reason, self.stop_reason, self.routed_experts if finished else None)
        self.sent_chars, self.sent_tokens, self.sent_finish = end, len(self.token_ids), finished
        return out


@dataclass
class _Parent:
    request_id: str
    prompt: ProcessedPrompt
    children: dict[str, _Child]
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    added_time: float = field(default_factory=time.monotonic)  # handed to the engine core (about)
    error: str | None = None   # set when a failed step finished the request
    # SamplingParams.prompt_logprobs (None: not asked); the prompt's entries once they came (with
    # sequence 0's first token: only it computes them), and whether a delta handed them out.
    prompt_logprobs_k: int | None = None
    prompt_logprobs: list | None = None
    sent_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())

    def to_output(self) -> RequestOutput:
        outs = [CompletionOutput(c.index, c.detokenizer.output_text, list(c.token_ids), c.cumulative_logprob,
                                 c.logprobs, c.finish_reason, c.stop_reason, c.routed_experts)
                for c in sorted(self.children.values(), key=lambda c: c.index)]
        return RequestOutput(self.request_id, self.prompt.prompt, self.prompt.prompt_token_ids, outs,
                             self.finished, self.prompt_logprobs, num_cached_tokens=self.num_cached_tokens,
                             error=self.error)

    def delta_output(self) -> RequestOutput:
        """Only what is new since the last call, per sequence (streaming). With prompt_logprobs the
        first delta carries them (vLLM's streaming shape) and no sequence's output goes out before
        they have come (sequence 0 computes them; another may reach its first token first)."""
        finished = self.finished
        if self.prompt_logprobs_k is not None and self.prompt_logprobs is None and not finished:
            return RequestOutput(self.request_id, self.prompt.prompt, self.prompt.prompt_token_ids, [], False,
                                 num_cached_tokens=self.num_cached_tokens)
        outs = [d for c in sorted(self.children.values(), key=lambda c: c.index) if (d := c.delta()) is not None]
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.sent_prompt_logprobs and (outs or finished):
            prompt_logprobs, self.sent_prompt_logprobs = self.prompt_logprobs, True
        return RequestOutput(self.request_id, self.prompt.prompt, self.prompt.prompt_token_ids, outs,
                             finished, prompt_logprobs, num_cached_tokens=self.num_cached_tokens, error=self.error)


@dataclass
class ProcessResult:
    updated: list[_Parent] = field(default_factory=list)   # requests with new output, in order
    finished: list[_Parent] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)       # sequences a stop string ended: finish in the core
    aborted: list[str] = field(default_factory=list)       # sequences to abort in the core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, metrics: EngineMetrics, log_stats: bool = False,
                 stats_interval_s: float = STATS_INTERVAL_S, count_core_totals: bool = True,
                 record_latencies: bool = True) -> None:
        """count_core_totals: add the core's preemption / prefix-cache totals to the counters (one
        API process of several does). record_latencies: fill the latency histograms (TTFT,
        inter-token, end-to-end, queue / prefill / decode / inference time; a few microseconds
        per token)."""
        self.tokenizer = tokenizer
        self.count_core_totals = count_core_totals
        self.record_latencies = record_latencies
        self.metrics = metrics
        self.log_stats = log_stats
        self.stats_interval_s = stats_interval_s
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}
        self.stats = SchedulerStats()
        self._totals = SchedulerStats()
        self._generation_total = 0
        self._last_stats_log = time.monotonic()
        self._last_logged_generation = 0
        self.expert_load_layers: list[int] | None = None  # the MoE layers of the expert-load windows
        self.expert_balancedness: float | None = None     # mean over layers, last window

    def has_request(self, request_id: str) -> bool:
        return request_id in self.parents or request_id in self.child_to_parent

    def add_request(self, request_id: str, prompt: ProcessedPrompt, core_requests: list[CoreRequest],
                    arrival_time: float | None = None) -> None:
        children = {}
        for i, cr in enumerate(core_requests):
            p = cr.params
            children[cr.request_id] = _Child(i, IncrementalDetokenizer(
                self.tokenizer if p.detokenize else None, prompt.prompt_token_ids, p.stop_list,
                p.include_stop_str_in_output, p.skip_special_tokens), p,
                logprobs=[] if p.logprobs is not None else None,
                cumulative_logprob=0.0 if p.logprobs is not None else None, max_tokens=cr.max_tokens)
        parent = _Parent(request_id, prompt, children, prompt_logprobs_k=core_requests[0].params.prompt_logprobs)
        if arrival_time is not None:
            parent.arrival_time = arrival_time
        self.parents[request_id] = parent
        for child_id in children:
            self.child_to_parent[child_id] = request_id

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request (by its id or one sequence's); returns its sequences' core ids."""
        parent = self.parents.pop(self.child_to_parent.get(request_id, request_id), None)
        if parent is None:
            return []
        for child_id, child in parent.children.items():
            if self.child_to_parent.pop(child_id, None) is not None and child.finish_reason is None:
                self.metrics.request_success["abort"].inc()
        return list(parent.children)

    def process(self, result: CoreStepResult) -> ProcessResult:
        step_tokens = self._count_step(result)
        now = time.monotonic()
        out = ProcessResult()
        updated: dict[str, _Parent] = {}  # insertion-ordered, one entry per request
        gaps: dict[float, int] = {}  # the step's inter-token latencies: value -> tokens
        for co in result.outputs:
            parent_id = self.child_to_parent.get(co.req_id)
            if parent_id is None:
                continue  # finished or aborted here already (a late output from a separate core)
            parent = self.parents[parent_id]
            child = parent.children[co.req_id]
            if child.params.n == 1 or co.num_cached_tokens:
                parent.num_cached_tokens = max(parent.num_cached_tokens, co.num_cached_tokens)
            if co.new_token_ids and self.record_latencies:
                self._observe_token_times(child, now, len(co.new_token_ids), parent.arrival_time, gaps)
            if co.finish_reason == "error":
                self._fail(parent, co.req_id, result.errors.get(co.req_id, "the engine failed this request"), out, now)
            else:
                if parent.prompt_logprobs_k is not None and parent.prompt_logprobs is None and child.index == 0 \
                        and co.new_token_ids:
                    parent.prompt_logprobs = self._prompt_logprob_list(parent.prompt.prompt_token_ids,
                                                                       co.prompt_logprobs)
                step_tokens += self._process_tokens(co, child, len(parent.prompt.prompt_token_ids), out)
                if co.routed_experts is not None:
                    if child.routed is None:
                        child.routed = RoutedRows()
                    child.routed.write(co.routed_experts_start, co.routed_experts)
                if child.finish_reason is not None and child.routed is not None:
                    # every prompt token and every generated one but the last went through a forward
                    child.routed_experts = child.routed.view(len(parent.prompt.prompt_token_ids)
                                                             + len(child.token_ids) - 1)
                if child.finish_reason is not None:
                    self.child_to_parent.pop(co.req_id, None)
                    self._observe_finished(parent, child, now)
            updated[parent_id] = parent
            if child.finish_reason is not None and parent_id in self.parents and parent.finished:
                del self.parents[parent_id]
                self.metrics.observe_finished_parent(
                    len(parent.children), max(len(c.token_ids) for c in parent.children.values()))
                out.finished.append(parent)
        for gap, count in gaps.items():
            observe_repeated(self.metrics.inter_token_latency, gap, count)
        if result.outputs:
            self.metrics.iteration_tokens.observe(step_tokens)
        out.updated = list(updated.values())
        self._maybe_log_stats()
        return out

    def _fail(self, parent: _Parent, failed_id: str, error: str, out: ProcessResult, now: float) -> None:
        """A failed step finished one sequence with an error (the core dropped it): the whole
        request ends with it, its other sequences aborted."""
        for cid, c in parent.children.items():
            if c.finish_reason is None:
                c.finish_reason = "error"
                if self.child_to_parent.pop(cid, None) is not None:
                    self._observe_finished(parent, c, now)
                    if cid != failed_id:
                        out.aborted.append(cid)
        parent.error = error

    def _observe_token_times(self, child: _Child, now: float, num_tokens: int, arrival_time: float,
                             gaps: dict[float, int]) -> None:
        """TTFT at a sequence's first token; later tokens add their gap to `gaps` (value -> count),
        observed once per distinct value at the end of the step."""
        if child.first_token_time is None:
            child.first_token_time = now
            self.metrics.time_to_first_token.observe(now - arrival_time)
        elif child.last_token_time is not None:
            gap = (now - child.last_token_time) / num_tokens
            gaps[gap] = gaps.get(gap, 0) + num_tokens
        child.last_token_time = now

    def _observe_finished(self, parent: _Parent, child: _Child, now: float) -> None:
        """A sequence finished (stop, length or error): request_success and the per-request histograms."""
        first, last, scheduled = child.first_token_time, child.last_token_time, child.scheduled_time
        timed = self.record_latencies and first is not None and last is not None
        self.metrics.observe_finished(FinishedRequestStats(
            child.finish_reason, len(parent.prompt.prompt_token_ids), len(child.token_ids), child.max_tokens,
            e2e=now - parent.arrival_time if self.record_latencies else None,
            prefill=max(first - scheduled, 0.0) if timed and scheduled is not None else None,
            decode=last - first if timed else None,
            inference=max(last - scheduled, 0.0) if timed and scheduled is not None else None))

    def _process_tokens(self, co, child: _Child, num_prompt_tokens: int, out: ProcessResult) -> int:
        """Takes the sequence's new tokens; returns the prompt tokens counted (at its first tokens)."""
        counted = 0
        if not child.token_ids:
            self.metrics.prompt_tokens.inc(num_prompt_tokens)
            counted = num_prompt_tokens
        child.token_ids.extend(co.new_token_ids)
        if co.new_logprobs and child.logprobs is not None:
            for entry in co.new_logprobs:
                child.logprobs.append(self._to_logprob_dict(entry))
                child.cumulative_logprob += entry.logprob
        # A stop token's own text is not part of the output (unless asked for); a grammar that is
        # complete ends on a token of the output's text.
        stopped_by_token = co.finish_reason == "stop" and not co.stopped_by_grammar \
            and not child.params.include_stop_str_in_output
        text_tokens = co.new_token_ids[:-1] if stopped_by_token else co.new_token_ids
        stop_str = child.detokenizer.update(text_tokens)
        if stop_str is None and co.finished:
            stop_str = child.detokenizer.flush()
        if stop_str is not None and not co.finished:
            out.stopped.append(co.req_id)
            child.finish_reason, child.stop_reason = "stop", stop_str
        elif stop_str is not None:
            child.finish_reason, child.stop_reason = "stop", stop_str
        elif co.finished:
            child.finish_reason, child.stop_reason = co.finish_reason, co.stop_reason
        return counted

    def _prompt_logprob_list(self, prompt_ids: list[int], plp: PromptLogprobs | None) -> list:
        """vLLM's prompt_logprobs: one entry per prompt token, None for the first (nothing scores
        it), else {token id: Logprob} of the prompt token (its own rank) and the top-k of its
        position (ranks 1..k), the prompt token first."""
        out: list = [None] * len(prompt_ids)
        if plp is None:
            return out
        n = len(plp.logprobs)
        ids = prompt_ids[plp.start:plp.start + n]
        texts: dict[int, str | None] = {}
        if self.tokenizer is not None:  # each distinct id decoded once, in one call
            unique = list(dict.fromkeys([*ids, *(t for top in plp.top_ids for t in top)]))
            texts = dict(zip(unique, self.tokenizer.decode_tokens(unique)))
        for r, tid in enumerate(ids):
            entry = {tid: Logprob(plp.logprobs[r], plp.ranks[r], texts.get(tid))}
            for rank, (t, lp) in enumerate(zip(plp.top_ids[r], plp.top_logprobs[r]), start=1):
                if t not in entry:
                    entry[t] = Logprob(lp, rank, texts.get(t))
            out[plp.start + r] = entry
        return out

    def _to_logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = self.tokenizer.decode_token if self.tokenizer is not None else (lambda t: None)
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
        for rank, (tid, lp) in enumerate(zip(entry.top_ids, entry.top_logprobs), start=1):
            if tid not in out:
                out[tid] = Logprob(lp, rank, decode(tid))
        return out

    # ---- metrics -----------------------------------------------------------------------
    def _count_step(self, result: CoreStepResult) -> int:
        """The step's counters and gauges; returns the tokens it generated."""
        m = self.metrics
        generated = sum(len(co.new_token_ids) for co in result.outputs)
        m.generation_tokens.inc(generated)
        self._generation_total += generated
        if self.record_latencies:
            for req_id, queue_s in result.queue_times.items():
                m.request_queue_time.observe(queue_s)
                parent = self.parents.get(self.child_to_parent.get(req_id, ""))
                if parent is not None:  # first scheduled: about when the core got it, plus its wait
                    parent.children[req_id].scheduled_time = parent.added_time + queue_s
        self.update_stats(result.stats)
        for window in result.expert_load_windows:
            self.expert_balancedness = sum(window["balancedness"]) / max(len(window["balancedness"]), 1)
            if self.expert_load_layers is not None:
                m.observe_expert_load(self.expert_load_layers, window, self.count_core_totals)
        return generated

    def update_stats(self, s: SchedulerStats) -> None:
        m, t = self.metrics, self._totals
        self.stats = s
        m.num_requests_running.set(s.num_running)
        m.num_requests_waiting.set(s.num_waiting)
        m.kv_cache_usage_perc.set(s.kv_cache_usage)
        if not self.count_core_totals:
            return
        # The scheduler keeps running totals; the counters take the increments.
        m.num_preemptions.inc(max(s.num_preemptions - t.num_preemptions, 0))
        m.prefix_cache_queries.inc(max(s.prefix_cache_queries - t.prefix_cache_queries, 0))
        m.prefix_cache_hits.inc(max(s.prefix_cache_hits - t.prefix_cache_hits, 0))
        t.num_preemptions = max(t.num_preemptions, s.num_preemptions)
        t.prefix_cache_queries = max(t.prefix_cache_queries, s.prefix_cache_queries)
        t.prefix_cache_hits = max(t.prefix_cache_hits, s.prefix_cache_hits)

    def _maybe_log_stats(self) -> None:
        if not self.log_stats:
            return
        now = time.monotonic()
        elapsed = now - self._last_stats_log
        if elapsed < self.stats_interval_s:
            return
        s = self.stats
        expert = "" if self.expert_balancedness is None else \
            f"Expert load balancedness: {self.expert_balancedness:.3f}, "
        logger.info(
            "Avg generation throughput: %.1f tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: "
            "%.1f%%, Prefix cache hit rate: %.1f%%, %stotal_cumulative_preemption_cnt=%d",
            (self._generation_total - self._last_logged_generation) / elapsed, s.num_running, s.num_waiting,
            100 * s.kv_cache_usage, 100 * s.prefix_cache_hits / s.prefix_cache_queries
            if s.prefix_cache_queries else 0.0, expert, s.num_preemptions)
        self._last_logged_generation = self._generation_total
        self._last_stats_log = now
