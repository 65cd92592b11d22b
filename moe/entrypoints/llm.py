"""`LLM`: the offline Python API, shaped like vLLM's."""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Iterable, Sequence

from tqdm.auto import tqdm

from moe.config import EngineArgs
from moe.engine.input_processor import ProcessedPrompt
from moe.engine.llm_engine import LLMEngine
from moe.engine.metrics import Metric
from moe.errors import RequestFailed
from moe.expert_load.tracker import ExpertLoad, ExpertLoadAPI
from moe.outputs import RequestOutput
from moe.sampling_params import SamplingParams


class LLM:
    """An engine over one model for batch generation.

    Arguments carry vLLM's names (see `EngineArgs`): model, tokenizer, dtype, seed, max_model_len,
    block_size, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
    num_gpu_blocks_override, enable_prefix_caching, load_format, disable_log_stats, device, ...

    Threads: `generate` may be called from several threads at once. The calls share the engine:
    each adds its requests, and whichever caller holds the engine lock runs the next step for
    all of them (one merged batch), so each caller gets exactly its own outputs.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        valid = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()
        # Guards the engine (adding, stepping, aborting) and the outputs finished for any caller.
        self._lock = threading.Lock()
        self._done: dict[str, RequestOutput] = {}
        self._shut_down = False

    def _engine(self) -> LLMEngine:
        """The engine, or a RuntimeError once shut down: its workers and KV cache are gone, and a
        method that quietly answered from what is left would mislead."""
        if self._shut_down:
            raise RuntimeError("this LLM was shut down (LLM.shutdown or the end of its `with` block): make a new LLM")
        return self.llm_engine

    def get_tokenizer(self):
        """The model's tokenizer: encode(text, add_special_tokens=True) -> ids, decode(ids,
        skip_special_tokens=True) -> text, eos_token_id, vocab_size (None without tokenizer.json)."""
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns one RequestOutput per prompt, in input order.

        A prompt is a string, {"prompt": str} or {"prompt_token_ids": [int, ...]}; either dict may
        carry "multi_modal_data": {"image": image or [images]} (PIL images, encoded bytes or base64
        data URLs), one per <|image|> placeholder of the prompt, in order. sampling_params
        is one SamplingParams for every prompt or a list of them, one per prompt (not a dict: pass
        SamplingParams(**d)). A prompt whose request fails in a step raises `RequestFailed`.
        """
        if prompts is None:
            raise ValueError("prompts is None: pass a string, a prompt dict, or a list of them")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        # bytes iterate as ints and a number not at all: either would fail later, naming neither.
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError("prompts must be a string, a prompt dict ({'prompt': str} or {'prompt_token_ids': "
                            f"[int, ...]}}) or a list of them, got {type(prompts).__name__}")
        return self._generate(list(prompts), None, sampling_params, use_tqdm)

    def _generate(self, prompts: list, processed: list[ProcessedPrompt] | None, sampling_params,
                  use_tqdm: bool) -> list[RequestOutput]:
        """generate() of prompts, or of prompts processed already (chat: rendered, images expanded)."""
        engine = self._engine()
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, dict):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got a dict "
                            f"{sampling_params!r}: pass SamplingParams(**params)")
        if not isinstance(sampling_params, (SamplingParams, Iterable)) or isinstance(sampling_params, (str, bytes)):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        # Validate every prompt and parameter set before queueing any: one bad input leaves nothing behind.
        for sp in params:
            engine.check_params(sp)
        if processed is None:
            processed = [engine.process_prompt(p, sp) for p, sp in zip(prompts, params)]
        else:
            processed = [engine.truncate_prompt(p, sp) for p, sp in zip(processed, params)]
        with self._lock:
            ids = [str(next(self._counter)) for _ in prompts]
        try:
            with self._lock:
                for rid, prompt, p, sp in zip(ids, prompts, processed, params):
                    engine.add_request(rid, prompt, sp, processed=p)
            outs = self._run(ids, use_tqdm)
        except BaseException:
            with self._lock:
                engine.abort_request(ids)
                for rid in ids:
                    self._done.pop(rid, None)
            raise
        failed = next((o for o in outs if o.error is not None), None)
        if failed is not None:
            raise RequestFailed(failed.request_id, failed.error)
        return outs

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role": ..., "content": ...}, ...]) or a list of
        them, each rendered with the checkpoint's chat template (tokenizer_config.json) or
        `chat_template`; returns one RequestOutput per conversation. tools (OpenAI's
        [{"type": "function", "function": {"name", "description", "parameters"}}]) go to the template
        as `tools`, as vLLM's LLM.chat passes them; the reply is the model's text (calls are parsed
        by `moe serve --tool-call-parser`)."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        processed = [self._engine().input.process_chat(conv, add_generation_prompt, chat_template, tools,
                                                        **(chat_template_kwargs or {})) for conv in messages]
        prompts = [{"prompt": p.prompt, "prompt_token_ids": p.prompt_token_ids} for p in processed]
        return self._generate(prompts, processed, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `ids` is done. Any caller's step serves every
        caller's requests; outputs of other callers are left in `_done` for them."""
        engine = self.llm_engine
        mine: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm,
                   postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        start, n_in, n_out = time.perf_counter(), 0, 0
        while len(mine) < len(ids):
            with self._lock:
                if not any(i in self._done for i in ids):
                    if not engine.has_unfinished_requests():
                        missing = [i for i in ids if i not in mine]
                        raise RuntimeError(f"the engine has no unfinished request, but request(s) {missing} "
                                           "never finished (aborted by another caller?)")
                    for out in engine.step():
                        self._done[out.request_id] = out
                new = [self._done.pop(i) for i in ids if i in self._done]
            for out in new:
                mine[out.request_id] = out
                n_in += len(out.prompt_token_ids)
                n_out += sum(len(o.token_ids) for o in out.outputs)
                elapsed = max(time.perf_counter() - start, 1e-9)
                bar.postfix = f"est. speed input: {n_in / elapsed:.2f} toks/s, output: {n_out / elapsed:.2f} toks/s"
                bar.update(1)
        bar.close()
        return [mine[i] for i in ids]

    def get_metrics(self) -> list[Metric]:
        return self._engine().get_metrics()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel layout now (they also stop when the LLM is
        garbage-collected or the interpreter exits). Also `with LLM(...) as llm:`. Calling it
        again does nothing; any other method then raises RuntimeError."""
        if self._shut_down:
            return
        self._shut_down = True
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def reset_prefix_cache(self) -> None:
        engine = self._engine()
        with self._lock:
            engine.scheduler.kv.reset_prefix_cache()

    # ---- RL rollouts: weight updates and sleep mode ------------------------------------------
    def update_weights(self, named_tensors) -> int:
        """Load (Hugging Face name, tensor) pairs, any subset of the checkpoint's tensors, into the
        model in place on every rank (the loader's name rules, tensor- and expert-parallel slicing and
        checks, as at load); the prefix cache is reset. Needs an idle, awake engine. Returns the
        pieces loaded over all ranks."""
        engine = self._engine()
        with self._lock:
            return engine.core.update_weights(named_tensors)

    def sleep(self, level: int = 1) -> None:
        """Free the GPU for something else between rollouts: the KV cache and CUDA graphs go; level 1
        moves the weights to host memory, level 2 drops them (load new ones with update_weights after
        wake_up). Needs an idle engine; requests are refused until wake_up."""
        engine = self._engine()
        with self._lock:
            engine.core.sleep(level)

    def wake_up(self) -> None:
        """Restore what sleep freed: the weights (level 1), the KV cache and the CUDA graphs."""
        engine = self._engine()
        with self._lock:
            engine.core.wake_up()

    def is_sleeping(self) -> bool:
        return bool(self._engine().core.sleeping)

    # ---- expert load ---------------------------------------------------------------------
    def get_expert_load(self) -> ExpertLoad:
        """Tokens routed to each expert of each MoE layer since start-up or the last reset
        (moe/expert_load/tracker.py's ExpertLoad: counts [layers, experts], layers, per_rank, balancedness)."""
        with self._lock:
            return self._expert_load().get()

    def reset_expert_load(self) -> None:
        with self._lock:
            self._expert_load().reset()

    def start_expert_load_recording(self, path: str) -> None:
        """Write a window of expert load every expert_load_window_steps steps to `path` (JSON lines;
        `moe dashboard PATH` shows it)."""
        with self._lock:
            self._expert_load().start_recording(path)

    def stop_expert_load_recording(self) -> None:
        with self._lock:
            self._expert_load().stop_recording()

    def _expert_load(self) -> "ExpertLoadAPI":
        core = self._engine().core
        if core.expert_load is None:
            raise RuntimeError("no expert load is recorded: the model has no MoE layer, or record_expert_load=False")
        return ExpertLoadAPI(core)

