"""StructuredOutputManager: the grammar state of the engine core's structured requests (vLLM's
StructuredOutputManager), on llguidance or xgrammar (config.StructuredOutputsConfig picks per request;
grammar.LLGuidanceBackend and xgrammar_backend.XgrammarBackend share one interface).

It lives beside the scheduler, in the engine core's process:

* Compilation runs in a thread pool (both libraries drop the GIL while they build a grammar), cached
  by the library's key of the spec (kind, spec and options): a request waits for its grammar
  (RequestStatus.WAITING_FOR_FSM, which the scheduler passes over) while the others run.
  A compiled grammar is a template; each sequence gets its own matcher (n > 1: one each).
* Each step, the sequences that sample get their allowed tokens as rows of an int32 bitmask
  [rows, ceil(V / 32)] (bit t % 32 of word t // 32 is token t), filled on the host, which travels
  in the SchedulerOutput to the runner (the sampler applies it on the device).
* After each step the matchers consume the sampled tokens. A matcher that reaches the end of its
  grammar finishes its request (finish_reason "stop"); one that refuses a token (the mask makes
  that impossible) finishes it with an error.

Invariant: a sequence's matcher has consumed exactly its output tokens so far. A preempted
sequence keeps them (RECOMPUTE recomputes the KV only), a dropped in-flight token was never
consumed, a failed step's tokens are never applied: nothing needs rolling back.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
from collections import OrderedDict

import numpy as np

from moe.structured_output.config import StructuredOutputsConfig
from moe.structured_output.grammar import LLGuidanceBackend
from scheduler import Request, RequestStatus
from scheduler.output import EngineCoreOutput, SchedulerOutput

logger = logging.getLogger("moe.structured_output")

_CACHE_SIZE = 256          # compiled grammars kept (templates; requests hold their own copies)
_POLL_WAIT_S = 0.05        # how long an idle engine waits for a compilation before it steps again


def _backend_class(name: str):
    if name == "xgrammar":
        from moe.structured_output.xgrammar_backend import XgrammarBackend
        return XgrammarBackend
    return LLGuidanceBackend


def _compile(backend_future: cf.Future, params):
    """A compiled grammar (raises ValueError with the library's message)."""
    return backend_future.result().compile(params)


class _Sequence:
    """One structured sequence: its scheduler request, its grammar (compiling), the library that
    runs it and its matcher."""
    __slots__ = ("request", "kind", "backend_name", "future", "backend", "matcher")

    def __init__(self, request: Request, kind: str, backend_name: str, future: cf.Future) -> None:
        self.request, self.kind, self.backend_name, self.future = request, kind, backend_name, future
        self.backend = self.matcher = None


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                 config: StructuredOutputsConfig | None = None, max_workers: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.config = config or StructuredOutputsConfig()
        workers = max_workers or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moe-grammar")
        self._tokenizer_args = (tokenizer, vocab_size, tuple(eos_token_ids))
        # A library's tokenizer is built once (about a second for a 150k vocabulary), off the step
        # loop like the grammars, when its first request arrives.
        self._backends: dict[str, cf.Future] = {}
        self._cache: OrderedDict[str, cf.Future] = OrderedDict()
        self._sequences: dict[str, _Sequence] = {}
        self._compiling: dict[str, _Sequence] = {}
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and logs

    def _backend(self, name: str) -> cf.Future:
        future = self._backends.get(name)
        if future is None:
            future = self._backends[name] = self._pool.submit(_backend_class(name), *self._tokenizer_args)
        return future

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Track a structured request (before the scheduler sees it): it waits for its grammar
        unless the cache holds it compiled already. Raises ValueError for a spec its library cannot
        translate."""
        params = self.config.apply(request.sampling_params.structured_outputs)
        name = self.config.backend_for(params)
        key = _backend_class(name).key(params)
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self._pool.submit(_compile, self._backend(name), params)
            self.num_compiled += 1
            self._cache[key] = future
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        seq = _Sequence(request, params.kind, name, future)
        self._sequences[request.request_id] = seq
        if not (future.done() and self._start(seq) is None):
            request.status = RequestStatus.WAITING_FOR_FSM
            self._compiling[request.request_id] = seq

    def remove(self, request_ids) -> None:
        """Sequences that left the engine (finished, aborted)."""
        for rid in request_ids:
            if self._sequences.pop(rid, None) is not None:
                self._compiling.pop(rid, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sequences

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def _start(self, seq: _Sequence) -> str | None:
        """Give a sequence whose grammar is compiled its matcher; its error message if it failed."""
        exc = seq.future.exception()
        if exc is not None:
            return f"invalid structured_outputs.{seq.kind}: {exc}"
        seq.backend = self._backends[seq.backend_name].result()
        seq.matcher = seq.backend.matcher(seq.future.result())
        return None

    def poll(self, block: bool = False) -> dict[str, str]:
        """Move the sequences whose grammar is ready to the scheduler's waiting state; returns the
        ones whose grammar failed (request id -> message; the caller finishes them). block: wait a
        little for one when nothing else can run."""
        if not self._compiling:
            return {}
        if block and not any(s.future.done() for s in self._compiling.values()):
            cf.wait([s.future for s in self._compiling.values()], timeout=_POLL_WAIT_S,
                    return_when=cf.FIRST_COMPLETED)
        errors = {}
        for rid, seq in list(self._compiling.items()):
            if not seq.future.done():
                continue
            del self._compiling[rid]
            error = self._start(seq)
            if error is not None:
                errors[rid] = error
                self._sequences.pop(rid, None)
            elif seq.request.status == RequestStatus.WAITING_FOR_FSM:
                seq.request.status = RequestStatus.WAITING
        return errors

    # ---- each step ---------------------------------------------------------------------
    def fill_bitmask(self, so: SchedulerOutput) -> None:
        """The allowed tokens of the step's structured sequences that sample (their scheduled tokens
        reach the end of their known ones: a prefill chunk short of it samples nothing), into
        so.grammar_bitmask [rows, num_words] int32 with so.structured_output_request_ids naming
        the rows. Under async scheduling a sequence whose previous token is still in flight (two
        placeholders: that one and this step's) cannot be masked yet: it is named in
        so.deferred_grammar_ids, and fill_deferred adds its row once that token is consumed."""
        if not self._sequences:
            return
        rows, deferred = [], []
        for rid in so.num_scheduled_tokens:
            seq = self._sequences.get(rid)
            if seq is not None and seq.matcher is not None and \
                    seq.request.num_computed_tokens >= seq.request.num_tokens:
                (deferred if seq.request.num_output_placeholders > 1 else rows).append((rid, seq))
        so.deferred_grammar_ids = [rid for rid, _ in deferred]
        self._set_rows(so, rows)

    def fill_deferred(self, so: SchedulerOutput) -> None:
        """Add the rows of so.deferred_grammar_ids, now that their in-flight tokens are consumed (a
        sequence that finished with that token gets none: the step's token for it is dropped)."""
        ids, so.deferred_grammar_ids = so.deferred_grammar_ids, []
        rows = [(rid, self._sequences[rid]) for rid in ids if rid in self._sequences]
        if not rows:
            return
        earlier = so.structured_output_request_ids
        bitmask = so.grammar_bitmask
        self._set_rows(so, rows)
        if earlier:
            so.structured_output_request_ids = list(earlier) + so.structured_output_request_ids
            so.grammar_bitmask = np.concatenate([bitmask, so.grammar_bitmask])

    def _set_rows(self, so: SchedulerOutput, rows: list) -> None:
        if not rows:
            return
        bitmask = np.empty((len(rows), self.num_words), dtype=np.int32)
        for backend, group in _by_backend((seq, i) for i, (_, seq) in enumerate(rows)):
            backend.fill([(seq.matcher, i) for seq, i in group], bitmask)
        so.structured_output_request_ids = [rid for rid, _ in rows]
        so.grammar_bitmask = bitmask

    def advance(self, outputs: list[EngineCoreOutput]) -> tuple[list[str], dict[str, str]]:
        """Consume a step's new tokens. Returns the sequences whose grammar is now complete (to
        finish with "stop") and those whose matcher refused a token (request id -> message). The
        sequences that finished in this step are forgotten."""
        stopped, errors = [], {}
        singles, many = [], []
        for co in outputs:
            seq = self._sequences.get(co.req_id)
            if seq is None or not co.new_token_ids or seq.matcher is None:
                continue
            (singles if len(co.new_token_ids) == 1 else many).append((co, seq))
        accepted = {}
        for backend, group in _by_backend((seq, co) for co, seq in singles):
            ok = backend.consume([(seq.matcher, co.new_token_ids[0]) for seq, co in group])
            accepted.update((co.req_id, good) for (_, co), good in zip(group, ok))
        for co, seq in singles + many:
            good = accepted.get(co.req_id)
            if good is None:
                good = seq.backend.consume_tokens(seq.matcher, co.new_token_ids)
            if co.finish_reason is not None:
                self._sequences.pop(co.req_id, None)
            if not good:
                errors[co.req_id] = (f"structured_outputs.{seq.kind}: the grammar refused token "
                                     f"{co.new_token_ids[-1]} ({seq.backend.error(seq.matcher)})")
                self._sequences.pop(co.req_id, None)
            elif co.finish_reason is None and seq.backend.is_stopped(seq.matcher):
                stopped.append(co.req_id)
                self._sequences.pop(co.req_id, None)
        return stopped, errors

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _by_backend(items):
    """(backend, [(seq, x), ...]) per library among (seq, x) pairs (one group, normally)."""
    groups: dict[int, tuple[object, list]] = {}
    for seq, x in items:
        groups.setdefault(id(seq.backend), (seq.backend, []))[1].append((seq, x))
    return groups.values()
