"""`LLM`: the offline Python API, shaped like vLLM's."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from moe.config import EngineArgs
from moe.engine import LLMEngine
from moe.metrics import Metric
from moe.outputs import RequestOutput
from moe.sampling_params import SamplingParams


class LLM:
    """An engine over one model for batch generation.

    Arguments carry vLLM's names (see `EngineArgs`): model, tokenizer, dtype, seed, max_model_len,
    block_size, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
    num_gpu_blocks_override, enable_prefix_caching, load_format, disable_log_stats, device, ...
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        valid = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns one RequestOutput per prompt, in input order.

        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}.
        """
        engine = self.llm_engine
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # Validate every prompt before queueing any, so one bad prompt leaves nothing behind.
        processed = [engine.process_prompt(p) for p in prompts]
        ids = [str(next(self._counter)) for _ in prompts]
        try:
            for rid, prompt, p, sp in zip(ids, prompts, processed, params):
                engine.add_request(rid, prompt, sp, processed=p)
            return self._run(ids, use_tqdm)
        except BaseException:
            engine.abort_request(ids)
            raise

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start, n_in, n_out = time.perf_counter(), 0, 0
        while len(done) < len(ids) and engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
                n_in += len(out.prompt_token_ids)
                n_out += sum(len(o.token_ids) for o in out.outputs)
                elapsed = time.perf_counter() - start
                bar.postfix = f"est. speed input: {n_in / elapsed:.2f} toks/s, output: {n_out / elapsed:.2f} toks/s"
                bar.update(1)
        bar.close()
        return [done[i] for i in ids]

    def get_metrics(self) -> list[Metric]:
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel layout now (they also stop when the LLM is
        garbage-collected or the interpreter exits). Also `with LLM(...) as llm:`."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> None:
        self.llm_engine.scheduler.kv.reset_prefix_cache()
