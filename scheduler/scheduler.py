"""The step policy: a token budget per step, running requests first, chunked prefill,
RECOMPUTE preemption when KV blocks run out, prefix-cache reuse for new requests."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from scheduler.encoder_cache import EncoderCacheManager
from scheduler.kv_cache_manager import NO_NEW_BLOCKS, KVCacheManager
from scheduler.kv_cache_spec import KVCacheGroup
from scheduler.output import CachedRequestData, EngineCoreOutput, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus

logger = logging.getLogger("moe.scheduler")


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Block counts per KV-cache group (kv_cache_spec.plan_groups); None = one full-attention group.
    kv_cache_groups: list[KVCacheGroup] | None = None
    # Embeddings of image features the runner may hold (and compute per step); 0: no images.
    encoder_cache_size: int = 0
    # Schedule the next step while this one runs: a request whose step samples a token gets a
    # placeholder for it (Request.num_output_placeholders), which the next step computes.
    async_scheduling: bool = False
    # Async scheduling: a structured request may be scheduled with its token still in flight, its
    # grammar mask then filled once that token is known, before the step samples (the engine core
    # defers the step's sampling; in-process engines). False: it waits for the step after.
    defer_grammar_masks: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) with chunked prefill disabled, so a long prompt could never be "
                "scheduled; raise max_num_batched_tokens or enable chunked prefill")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_blocks * self.block_size} tokens, fewer than max_model_len={self.max_model_len}, "
                "so a request of that length could never run; increase gpu_memory_utilization / "
                "kv_cache_memory_bytes / num_gpu_blocks_override or decrease max_model_len")


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.kv_cache_groups)
        self.encoder = EncoderCacheManager(config.encoder_cache_size) if config.encoder_cache_size else None
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        # The runner holds state for these; after preemption it must be re-sent whole.
        self._runner_knows: set[str] = set()
        self.num_preemptions = 0

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.mm_items:
            if self.encoder is None:
                raise ValueError(f"request {request.request_id!r} has images, but this engine runs no image encoder")
            too_big = [m.num_embeds for m in request.mm_items if m.num_embeds > self.encoder.capacity]
            if too_big:
                raise ValueError(f"an image of request {request.request_id!r} has {too_big[0]} embeddings, more than "
                                 f"the encoder cache holds ({self.encoder.capacity})")
        request.max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> None:
        """Finish (abort, or stop on a stop string) requests; their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free_request(request, status)

    def free_resources(self, request: Request) -> None:
        """Its KV blocks and its images' encoder outputs."""
        self.kv.free(request)
        if self.encoder is not None:
            self.encoder.free(request)

    def _free_request(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.free_resources(request)
        del self.requests[request.request_id]
        self._runner_knows.discard(request.request_id)
        self._finished_since_last_step.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.free_resources(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # an in-flight token of a preempted request is dropped
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._runner_knows.discard(request.request_id)
        self.waiting.appendleft(request)
        logger.warning(
            "Sequence group %s is preempted by PreemptionMode.RECOMPUTE mode because there is not "
            "enough KV cache space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache memory. "
            "total_cumulative_preemption_cnt=%d", request.request_id, self.num_preemptions)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        preempted: set[str] = set()
        encoder = self.encoder
        encoder_budget = encoder.capacity if encoder is not None else 0
        scheduled_encoder: dict[str, list[int]] = {}
        if encoder is not None:
            encoder.free_all_passed(self.requests)

        # Running requests first (decodes and unfinished prefill chunks), in arrival order.
        # The hot loop of a large decode batch: names bound locally, cached requests recorded inline.
        allocate, runner_knows = self.kv.allocate_slots, self._runner_knows
        cached_ids, cached_blocks, cached_computed = (cached_reqs.req_ids, cached_reqs.new_block_ids,
                                                      cached_reqs.num_computed_tokens)
        placeholders, hold_structured = cfg.async_scheduling, not cfg.defer_grammar_masks
        # allocate_slots' common case, inline: one KV group, the last block has room for the new
        # tokens and the step fills no block (which prefix caching would register).
        kv = self.kv
        held_blocks = kv.req_to_blocks if not kv.local else None
        block_size, caching = kv.block_size, kv.enable_caching
        running = self.running
        for request in running:  # a preemption pops from the end: the loop stops before those
            if budget <= 0:
                break
            in_flight = request.num_output_placeholders
            num_tokens = len(request.all_token_ids) + in_flight  # known and in flight
            computed = request.num_computed_tokens
            num_new = num_tokens - computed
            if num_new > budget:
                num_new = budget
            if num_new <= 0 or (in_flight and ((request.use_structured_output and hold_structured)
                                               or num_tokens >= request.max_num_tokens)):
                # Nothing to compute (sync: cannot happen after update), or async: the tokens in
                # flight finish it (max_tokens, max_model_len), or its grammar mask needs the token in
                # flight. Keep the order.
                continue
            to_encode = None
            if request.mm_items:
                num_new, to_encode = encoder.plan(request, computed, num_new, encoder_budget)
                if num_new <= 0:  # its next image waits for room in the encoder cache
                    continue
            req_id = request.request_id
            blocks = held_blocks.get(req_id) if held_blocks is not None else None
            end = computed + num_new
            if blocks is not None and end <= len(blocks) * block_size and not (caching and end % block_size == 0):
                new_blocks = NO_NEW_BLOCKS
            else:
                while True:
                    new_blocks = allocate(request, num_new)
                    if new_blocks is not None:
                        break
                    victim = running.pop()  # the most recently arrived running request
                    self._preempt(victim)
                    preempted.add(victim.request_id)
                    if victim is request:
                        break
                if new_blocks is None:
                    break
            if to_encode:
                encoder_budget -= self._encode(request, to_encode, scheduled_encoder)
            num_scheduled[req_id] = num_new
            budget -= num_new
            if req_id in runner_knows:
                cached_ids.append(req_id)
                # Per group; the common decode step adds no block anywhere and sends ().
                cached_blocks.append([[b.block_id for b in g] for g in new_blocks] if new_blocks and any(new_blocks)
                                     else ())
                cached_computed.append(computed)
                request.num_computed_tokens = end
            else:
                self._record(request, new_blocks, num_new, new_reqs, cached_reqs)
            if placeholders and end == num_tokens:  # _add_placeholder, inline
                request.num_output_placeholders = in_flight + 1

        # Then waiting requests in arrival order (preempted ones were put back at the front),
        # unless this step had to preempt: the pool is too tight to admit more. Those whose
        # grammar is still compiling let the others pass and keep their place.
        compiling: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_FSM:
                compiling.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    break
                num_new = budget
            to_encode = None
            if request.mm_items:
                num_new, to_encode = encoder.plan(request, num_hit, num_new, encoder_budget)
                if num_new <= 0 or (num_new < request.num_tokens - num_hit and not cfg.enable_chunked_prefill):
                    break  # its first image waits for room in the encoder cache
            new_blocks = self.kv.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                break
            if to_encode:
                encoder_budget -= self._encode(request, to_encode, scheduled_encoder)
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._record(request, new_blocks, num_new, new_reqs, cached_reqs)
            if placeholders:
                self._add_placeholder(request)

        if compiling:
            self.waiting.extendleft(reversed(compiling))
        total = cfg.max_num_batched_tokens - budget
        assert total <= cfg.max_num_batched_tokens and len(self.running) <= cfg.max_num_seqs
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            preempted_req_ids=preempted,
            finished_req_ids=self._finished_since_last_step,
            scheduled_encoder_inputs=scheduled_encoder,
            free_encoder_inputs=encoder.take_freed() if encoder is not None else [],
        )
        self._finished_since_last_step = set()
        return out

    @staticmethod
    def _add_placeholder(request: Request) -> None:
        """Async scheduling: a step that reaches the end of the request's tokens samples one more."""
        if request.num_computed_tokens == len(request.all_token_ids) + request.num_output_placeholders:
            request.num_output_placeholders += 1

    def _encode(self, request: Request, indices: list[int], scheduled: dict[str, list[int]]) -> int:
        """Hold the images computed this step; their embeddings (what they take of the budget)."""
        self.encoder.allocate(request, indices)
        scheduled[request.request_id] = indices
        return sum(request.mm_items[i].num_embeds for i in indices)

    def _record(self, request: Request, new_blocks, num_new: int,
                new_reqs: list[NewRequestData], cached_reqs: CachedRequestData) -> None:
        if request.request_id in self._runner_knows:
            cached_reqs.req_ids.append(request.request_id)
            # Per group; the common decode step adds no block anywhere and sends ().
            cached_reqs.new_block_ids.append(
                [[b.block_id for b in g] for g in new_blocks] if any(new_blocks) else ())
            cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
        else:
            self._runner_knows.add(request.request_id)
            new_reqs.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                request.sampling_params, self.kv.block_ids(request), request.num_computed_tokens,
                request.mm_items))
        # The KV of these tokens is written during the step that is being planned now.
        request.num_computed_tokens += num_new

    # ---- after the step ----------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled: dict[str, list[int]],
                           logprobs: dict | None = None) -> list[EngineCoreOutput]:
        """Append the sampled tokens and apply the token-level stop conditions.

        `sampled` maps request id -> new token ids for the requests whose scheduled tokens
        reached the end of their known tokens (partial prefill chunks sample nothing).
        """
        outputs = []
        requests, running_status = self.requests, RequestStatus.RUNNING
        for req_id, new_tokens in sampled.items():
            request = requests.get(req_id)
            if request is None or request.status is not running_status or not new_tokens:
                continue  # aborted while the step ran
            if len(new_tokens) == 1:  # the usual case: one token, no list to build
                appended = new_tokens
                if request.num_output_placeholders:
                    request.num_output_placeholders -= 1
                token = new_tokens[0]
                all_ids = request.all_token_ids
                all_ids.append(token)
                status = None
                # _check_stop only where it may stop: a stopping token, or a length reached
                if token in request.stopping_tokens or len(all_ids) >= request.max_num_tokens:
                    status = self._check_stop(request, token)
                if status is not None:
                    self.running.remove(request)
                    self._free_request(request, status)
            else:
                appended = []
                status = None
                for token in new_tokens:
                    if request.num_output_placeholders:
                        request.num_output_placeholders -= 1
                    request.all_token_ids.append(token)
                    appended.append(token)
                    status = self._check_stop(request, token)
                    if status is not None:
                        self.running.remove(request)
                        self._free_request(request, status)
                        break
            outputs.append(EngineCoreOutput(
                req_id, appended, logprobs.get(req_id) if logprobs else None,
                None if status is None else request.finish_reason.value,
                request.stop_reason, request.num_cached_tokens))
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        # Runs once per request per step: kept to plain attribute reads.
        num_tokens = len(request.all_token_ids)
        num_output = num_tokens - request.num_prompt_tokens
        if token in request.stopping_tokens and num_output >= request.min_tokens:
            is_eos = not request.ignore_eos and token in request.eos_token_ids
            request.stop_reason = None if is_eos else token
            return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None
