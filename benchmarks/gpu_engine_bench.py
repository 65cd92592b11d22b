"""The engine on one GPU, checked and timed in one call.

    python benchmarks/gpu_engine_bench.py parity qwen3 --out results.json

Stages:
  parity   each tiny checkpoint (benchmarks/make_gpu_checkpoints.py) and the built-in tiny model:
           greedy tokens on the GPU (fp32), eager and with CUDA graphs, equal the CPU's; prompts
           that span blocks, share prefixes (prefix-cache hits) and are split by chunked prefill.
  qwen3    a Qwen3-30B-A3B-shaped model with dummy bf16 weights through `LLM.generate`:
           decode step at 256 running requests, batch-1 and batch-32 TPOT, offline throughput
           at (1000 prompts, 1024 in, 256 out) and (256, 2048, 512); each against its floor.
           `--runs mixed`: real traffic offline, 400 prompts of 128-896 tokens generating 32-224
           tokens each (input 512 / output 128, range ratio 0.75, as `moe bench throughput
           --random-range-ratio` draws them) in one `LLM.generate`: wall time, output tok/s, the
           fraction of the floor, and per kind of step (decode-only, mixed prefill + decode,
           prefill-only) the count, seconds, ms and tokens per step, how many ran eagerly (not from
           CUDA graphs), device time and floor.
  structured TPOT of B = 1, 32, 256 requests under a JSON schema (llguidance masks) against plain ones,
           and 32 structured among 256, with the host's mask-fill time per step (synthetic 150k vocabulary).
  eager    the decode step at 256 again with enforce_eager=True (what the graphs buy).
  qwen3-tp2 (two GPUs) the qwen3 runs (--runs) under tensor_parallel_size=2 only.
  tp2      (two GPUs) tiny checkpoints' greedy tokens under tensor_parallel_size=2 (eager and CUDA
           graphs) equal the CPU's; the Qwen3-30B-A3B shape's decode step at 256 and throughput at
           (256, 2048, 512) with tensor_parallel_size=1 and 2, in the same run.
  dp2ep    (two GPUs) the decode step at 256 and 32 running requests (128 / 16 per replica) of the Qwen3-30B-A3B
           shape and of the DeepSeek-V3 shape cut to 4 layers, under data_parallel_size=2 + expert
           parallelism: all2all_backend "low_latency" with CUDA graphs and eager, "auto" (the default:
           low_latency with the bytes rule's fallback), "all_to_all" (eager: its count exchange syncs
           with the host), against tensor_parallel_size=2 with graphs.
  families a DeepSeek-V3 shape cut to 4 layers (1 dense + 3 MoE; bf16 experts), a Llama-4 Scout
           shape cut to 8 layers, gpt-oss-20b's shape (24 layers; experts in bf16, then kept MXFP4 as the
           hub has them), gpt-oss-120b's (MXFP4) and GLM-4.5-Air's cut to 8 layers (dummy weights):
           decode step at 64 and 256 running requests and an offline throughput run, each against its
           floor. `new-families`: the gpt-oss and GLM shapes alone (--runs to choose).
  mla-mixed MLA's steps (--runs, e.g. mixed_step mixed decode256): Moonlight-16B-A3B's shape whole (DeepSeek-V3's
           architecture, 27 layers of 64 experts) and the DeepSeek-V3 cut (--deepseek-layers; 3 for an H100);
           MOE_MLA_ABSORBED_TOKENS=0 for the eager mixed steps as the A/B's other side.
  hybrid   Qwen3-Next-80B-A3B's shape cut to 24 layers (18 Gated DeltaNet, 6 gated attention; 512 experts top-10
           and a shared one; --hybrid-layers 12 for a GPU of 80 GB), dummy weights: the family runs, floors
           counting each sequence's state read and written per step.
  profile  where a decode step's time goes at 256 and at 1 running requests: host time of each
           engine part, GPU time of one graph replay, and the top kernels of an eager step.
  replay   (--runs replay1 replay16 replay32 replay256) the decode graph's GPU time alone, replayed back to
           back: the steady measure for A/B runs of changes inside the forward.
  timeline (--runs timeline1 timeline256) a few decode steps under the profiler: the device's busy
           and idle time per step against the wall time, the kernels outside the layers, the steps that
           ran eagerly and the requests still running at the window's end (all of them: a steady batch).
  host     (--runs host256) host ms per step of each part (schedule, batch build, upload, replay,
           sampling inputs, output side, ...) over decode-only steps of 256 and mixed steps of 255
           decodes beside a 512-token prompt.

Floors (one H200), read off the built model: prefill FLOPs / 700 TFLOP/s + per decode step (bytes
of the weights the step touches + KV bytes it reads) / 4.8 TB/s. A step of B tokens touches each
layer's expert e with probability 1 - (1 - K/E)^B (uniform routing, as the dummy weights give);
the embedding table is not read (one row per token). Prefill FLOPs: 2 x (dense parameters + K/E x
expert parameters) per token, plus causal attention (QK and PV over half the prompt on average),
plus one lm_head row per prompt.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from moe.bench.common import DEEPSEEK_V3, QWEN3_30B_A3B
from moe.bench.engine_workload import random_token_requests
from moe import LLM, SamplingParams

HBM_BYTES_PER_S = 4.8e12
BF16_FLOP_PER_S = 700e12


# ---- parity -------------------------------------------------------------------------------
def _parity_prompts(vocab: int) -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(1, vocab) for _ in range(40)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 33, 100, 150)]
    prompts += [shared + [rng.randrange(1, vocab) for _ in range(n)] for n in (3, 20)]  # prefix-cache hits
    return [{"prompt_token_ids": p} for p in prompts]


def parity(results: dict, checkpoints: list[str], tp: int = 1, batched_tokens: int = 64) -> None:
    """Greedy tokens of each checkpoint on the GPU (eager, graphs) against the CPU's; batched_tokens: the
    step's token budget (64 chunks every prompt; 512 takes them all in one step, so the 150-token prompt
    reaches the gated delta rule's chunked kernel, which takes sequences of 128 tokens and more)."""
    from models.registry import load_model_config

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for model in ["tiny-qwen3-moe"] + checkpoints:
        name = os.path.basename(os.path.normpath(model))
        vocab = 512 if model == "tiny-qwen3-moe" else load_model_config(model)[1].vocab_size
        prompts = _parity_prompts(vocab)
        common = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=batched_tokens, max_num_seqs=8)
        with LLM(model, device="cpu", **common) as llm:
            cpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for mode, eager in (("eager", True), ("graphs", False)):
            with LLM(model, device="cuda", gpu_memory_utilization=0.2, enforce_eager=eager,
                     tensor_parallel_size=tp, **common) as llm:
                runner = getattr(llm.llm_engine.executor, "runner", None)  # in-process only
                graphs = runner.graphs if runner is not None else None
                gpu = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            same = sum(a == b for a, b in zip(cpu, gpu)) if len(cpu) == len(gpu) else 0
            mode = (mode if tp == 1 else f"tp{tp}-{mode}") + ("" if batched_tokens == 64 else f"-{batched_tokens}")
            results[f"parity/{name}/{mode}"] = {
                "identical": same, "of": len(prompts), "graphs_captured": 0 if graphs is None else len(graphs.graphs),
                "first_divergence": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                     for a, b in zip(cpu, gpu)]}
            print(f"parity {name} {mode}: {same}/{len(prompts)} identical to the CPU "
                  f"(graphs captured: {results[f'parity/{name}/{mode}']['graphs_captured']})", flush=True)
            torch.cuda.empty_cache()


# ---- floors -------------------------------------------------------------------------------
def _weights_in(name: str, p: torch.Tensor) -> int:
    """Weights a parameter holds (for FLOPs): MXFP4 packs two a byte, its scales hold none."""
    if p.dtype != torch.uint8:
        return p.numel()
    return 0 if name.endswith("_scale") else 2 * p.numel()


class Costs:
    """Bytes and FLOPs of a built model, for its floors."""

    def __init__(self, llm: LLM) -> None:
        from models.layers.attention import Attention
        from models.layers.mla_attention import MLAAttention
        from models.layers.moe import FusedMoE

        runner = llm.llm_engine.executor.runner
        model, cfg = runner.model, llm.llm_engine.model_config
        self.top_k = cfg.num_experts_per_tok
        params = dict(model.named_parameters())
        embed = sum(p.numel() * p.element_size() for n, p in params.items() if "embed_tokens" in n)
        self.expert_layers = [(m.num_experts, sum(p.numel() * p.element_size() for p in m.parameters()),
                               sum(_weights_in(n, p) for n, p in m.named_parameters()))
                              for m in model.modules() if isinstance(m, FusedMoE)]
        expert_bytes = sum(b for _, b, _ in self.expert_layers)
        self.dense_bytes = sum(p.numel() * p.element_size() for p in params.values()) - expert_bytes - embed
        embed_numel = embed // next(p.element_size() for n, p in params.items() if "embed_tokens" in n)
        self.dense_params = sum(_weights_in(n, p) for n, p in params.items()) \
            - sum(n for _, _, n in self.expert_layers) - embed_numel
        self.active_expert_params = sum(n * self.top_k / E for E, _, n in self.expert_layers)
        self.kv_bytes_per_token = runner.kv_cache_bytes_per_block() / runner.block_size
        # linear-attention layers (Qwen3-Next): each sequence of a step reads and writes its state
        self.state_bytes_per_seq = runner.recurrent_state_bytes(1)
        # sliding-window layers (gpt-oss) read at most their window: (share of the KV bytes, window)
        layers = model.attention_layers()
        windows = [getattr(m, "sliding_window", None) for m in layers]
        self.kv_window = (sum(w is not None for w in windows) / len(layers), max(w or 0 for w in windows))
        # attention FLOPs per (query, key) pair over all layers: 2 x (qk dim + v dim) x heads
        self.attn_flops_per_pair = sum(
            2 * m.num_heads * 2 * m.head_dim if isinstance(m, Attention) else
            2 * m.num_local_heads * (m.qk_head_dim + m.cfg.v_head_dim)
            for m in model.modules() if isinstance(m, (Attention, MLAAttention)))
        self.lm_head_params = cfg.vocab_size * cfg.hidden_size

    def decode_step_s(self, batch: int, mean_context: float) -> float:
        touched = sum(b * (1 - (1 - self.top_k / E) ** batch) for E, b, _ in self.expert_layers)
        share, window = self.kv_window
        read = mean_context * (1 - share) + min(mean_context, window) * share
        return (self.dense_bytes + touched + batch * (read * self.kv_bytes_per_token + 2 * self.state_bytes_per_seq)) \
            / HBM_BYTES_PER_S

    def prefill_s(self, num_prompts: int, input_len: int) -> float:
        per_token = 2 * (self.dense_params + self.active_expert_params)
        attention = self.attn_flops_per_pair * input_len * input_len / 2
        return num_prompts * (input_len * per_token + attention + 2 * self.lm_head_params) / BF16_FLOP_PER_S

    @staticmethod
    def of(llm: LLM) -> "Costs | None":
        """The model's costs when it runs in this process (one GPU), else None."""
        return Costs(llm) if hasattr(llm.llm_engine.executor, "runner") else None

    def run_s(self, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int) -> float:
        """Prefill at full rate plus decode in full batches of max_num_seqs (the ideal schedule)."""
        total = self.prefill_s(num_prompts, input_len)
        left = num_prompts
        while left > 0:
            batch = min(left, max_num_seqs)
            total += output_len * self.decode_step_s(batch, input_len + output_len / 2)
            left -= batch
        return total

    def lengths_run_s(self, lengths: list[tuple[int, int]], max_num_seqs: int) -> float:
        """run_s for requests of their own (input, output) lengths: each prompt's prefill at full
        rate plus every output token decoded in full batches of max_num_seqs at the tokens' mean
        context (the ideal schedule)."""
        total = sum(self.prefill_s(1, n_in) for n_in, _ in lengths)
        tokens = sum(n_out for _, n_out in lengths)
        context = sum(n_out * (n_in + n_out / 2) for n_in, n_out in lengths) / tokens
        full, rest = divmod(tokens, max_num_seqs)
        return total + full * self.decode_step_s(max_num_seqs, context) + \
            (self.decode_step_s(rest, context) if rest else 0.0)

    def step_s(self, tokens: int, attn_pairs: float, kv_read_tokens: float, sampled: int) -> float:
        """Roofline floor of one step of any kind: its FLOPs at peak or its bytes at HBM rate,
        whichever is longer. FLOPs: every token through the dense and the active expert weights,
        attention over `attn_pairs` (query, key) pairs, one lm_head row per sampled token. Bytes:
        the dense weights, the experts the step's tokens touch, the KV of `kv_read_tokens`, the recurrent
        state of each sampled sequence read and written (a chunk that samples nothing is not counted)."""
        flops = 2 * (self.dense_params + self.active_expert_params) * tokens + self.attn_flops_per_pair * attn_pairs \
            + 2 * self.lm_head_params * sampled
        touched = sum(b * (1 - (1 - self.top_k / E) ** tokens) for E, b, _ in self.expert_layers)
        moved = self.dense_bytes + touched + kv_read_tokens * self.kv_bytes_per_token \
            + 2 * self.state_bytes_per_seq * sampled
        return max(flops / BF16_FLOP_PER_S, moved / HBM_BYTES_PER_S)


# ---- the Qwen3-30B-A3B shape ----------------------------------------------------------------
def _qwen3_layers() -> int | None:
    """BENCH_QWEN3_LAYERS: the Qwen3-30B-A3B shape cut to that many layers (24: weights of ~31 GB, so an 80 GB
    GPU holds the KV of 256 running requests as an H200 holds the whole model's)."""
    layers = os.environ.get("BENCH_QWEN3_LAYERS")
    return int(layers) if layers else None


def _dummy_model(max_model_len: int) -> str:
    path = tempfile.mkdtemp()
    cfg = {**QWEN3_30B_A3B, "max_position_embeddings": max(max_model_len, 4096)}
    if _qwen3_layers():
        cfg["num_hidden_layers"] = _qwen3_layers()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _prompts(n: int, length: int, seed: int = 0, vocab: int = 129000) -> list[dict]:
    """Random token ids below every benchmarked model's vocabulary size."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(length)]} for _ in range(n)]


def decode_step(llm: LLM, num_requests: int, prompt_len: int, out_len: int) -> dict:
    """Median time of the decode-only steps of num_requests requests, timed around engine.step."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(_prompts(num_requests, prompt_len, seed=1)):
        engine.add_request(f"d{i}", p, params)
    times = []
    schedulers = engine.schedulers  # one per data-parallel replica
    # No device sync around a step: a synchronous step ends by waiting for its tokens anyway, and
    # with async scheduling a step returns while the next one runs (its time is the loop's period).
    while engine.has_unfinished_requests():
        # decode-only: nothing waiting and every request past its prompt (computed counts the
        # token being decoded, and with async scheduling the one in flight too)
        decode_only = all(not s.waiting and all(r.num_computed_tokens >= r.num_tokens - 1 for r in s.running)
                          for s in schedulers) and sum(len(s.running) for s in schedulers) == num_requests
        t = time.perf_counter()
        engine.step()
        if decode_only:
            times.append(time.perf_counter() - t)
    if not times:
        raise RuntimeError(f"no step ran all {num_requests} requests decode-only: raise out_len")
    times.sort()
    median = times[len(times) // 2]
    costs = Costs.of(llm)
    floor = costs.decode_step_s(num_requests, prompt_len + out_len / 2) if costs else None
    return {"num_requests": num_requests, "prompt_len": prompt_len, "steps_timed": len(times),
            "median_step_ms": median * 1e3, "floor_ms": floor and floor * 1e3,
            "time_over_floor": floor and median / floor}


def tpot(llm: LLM, batch: int, input_len: int, output_len: int) -> dict:
    """Time per output token: (generate N tokens - generate 1 token) / (N - 1), best of 3."""
    prompts = _prompts(batch, input_len, seed=2)

    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    t1, tn = timed(1), timed(output_len)
    per_token = (tn - t1) / (output_len - 1)
    floor = Costs(llm).decode_step_s(batch, input_len + output_len / 2)
    return {"batch": batch, "input_len": input_len, "output_len": output_len, "tpot_ms": per_token * 1e3,
            "floor_ms": floor * 1e3, "time_over_floor": per_token / floor, "ttft_s": t1}


def throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int, max_num_seqs: int) -> dict:
    prompts = _prompts(num_prompts, input_len, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    costs = Costs.of(llm)
    floor = costs.run_s(num_prompts, input_len, output_len, max_num_seqs) if costs else None
    return {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "elapsed_s": elapsed,
            "output_tok_s": generated / elapsed, "total_tok_s": (generated + num_prompts * input_len) / elapsed,
            "floor_s": floor, "floor_over_time": floor and floor / elapsed}


def _wrap_timer(obj, name: str, key: str, timers: dict) -> tuple:
    """Time each call of obj.name into timers[key] (obj may be an instance, a module or a class,
    whose method then becomes a static wrapper of the bound one). Returns (obj, name, the attribute
    as it was, or _MISSING) for putting it back."""
    before = obj.__dict__.get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name)
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        timers.setdefault(key, []).append(time.perf_counter() - t)
        return out
    setattr(obj, name, staticmethod(timed) if isinstance(obj, type) else timed)
    return obj, name, before


# ---- real traffic: varied lengths, steps by kind ---------------------------------------------
STEP_KINDS = ("decode", "mixed", "prefill", "empty")
_MISSING = object()


def _step_plan(so, requests: dict) -> tuple[int, int, float, float, int]:
    """What one SchedulerOutput asks for, read right after Scheduler.schedule (which has advanced
    each scheduled request's num_computed_tokens by its tokens): (prefill tokens, decode requests,
    attention (query, key) pairs, KV tokens read, rows sampled). A request's slice is a decode when
    it is the one token after its prompt or after a generated token; anything else (a prompt chunk,
    the recompute after a preemption) is prefill work."""
    prefill = decodes = sampled = 0
    pairs = kv = 0.0
    for rid, n in so.num_scheduled_tokens.items():
        req = requests[rid]
        end = req.num_computed_tokens
        before = end - n
        kv += end
        if n == 1 and before >= req.num_prompt_tokens:
            decodes += 1
            sampled += 1
            pairs += end
        else:
            prefill += n
            pairs += n * before + n * (n + 1) / 2
            sampled += end >= len(req.all_token_ids)  # the prompt's last chunk samples its first token
    return prefill, decodes, pairs, kv, sampled


def _kind(plan: tuple) -> str:
    prefill, decodes = plan[0], plan[1]
    return ("mixed" if decodes else "prefill") if prefill else ("decode" if decodes else "empty")


class StepKinds:
    """Each engine step's wall time by the kind of work it finished, read without changing the
    engine: Scheduler.schedule is wrapped to read what each SchedulerOutput asks for (_step_plan);
    the executor's execute_model (synchronous steps) and launch / collect (async scheduling) to see
    which scheduled step's work a call of LLMEngine.step finishes; LLMEngine.step (_wrap_timer) to
    time it. With async scheduling, step N launches its work and waits for step N-1's tokens, so
    its wall time is (in the steady state) step N-1's device time: it counts under N-1's kind; the
    first step finishes nothing ("launch_only"). Device time per scheduled step (in-process CUDA
    executors): CUDA events around its launch, stream-ordered, so from the end of the work queued
    before it to the end of its own, gaps for the host included. Each launched step's forward: eager
    (the runner's _forward ran) or a CUDA-graph replay (eager_steps per kind). Undone on exit."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.llm_engine
        self.scheduler, self.executor = self.engine.scheduler, self.engine.executor
        if not hasattr(self.scheduler, "requests"):
            raise RuntimeError("StepKinds reads one scheduler: no data parallelism")
        self.events = torch.cuda.is_available() and hasattr(self.executor, "runner") \
            and self.engine.core.device.type == "cuda"
        self.timers: dict[str, list[float]] = {}
        self.plans: dict[int, tuple] = {}      # id(SchedulerOutput) -> (it, its plan), until launched
        self.pending: dict[int, tuple] = {}    # id(PendingStep) -> (it, its plan), until collected
        self.finished: list[tuple[int, tuple | None]] = []  # (index of the engine step, plan finished)
        self.device: list[tuple[tuple | None, object, object]] = []  # (plan, start event, end event)
        self.runner = getattr(self.executor, "runner", None)  # in-process executors
        self.launched: list[tuple[tuple | None, bool]] = []  # (plan, whether its forward ran eagerly)
        self._saved: list[tuple[object, str, object]] = []

    def _patch(self, obj, name: str, fn=None) -> None:
        self._saved.append((obj, name, obj.__dict__.get(name, _MISSING)))
        if fn is not None:
            setattr(obj, name, fn)

    def _event(self):
        if not self.events:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def __enter__(self) -> "StepKinds":
        sched, ex = self.scheduler, self.executor
        schedule, execute, launch, collect = sched.schedule, ex.execute_model, ex.launch, ex.collect

        def index() -> int:  # the engine step running now: the timer appends after it returns
            return len(self.timers.get("step", ()))

        def planned(so):
            return self.plans.pop(id(so), (None, None))[1]

        def timed_schedule(*a, **k):
            so = schedule(*a, **k)
            self.plans[id(so)] = (so, _step_plan(so, sched.requests))
            return so

        def eager_forwards() -> int:  # the runner's eager forwards so far (a graph replay skips _forward)
            return len(self.timers.get("eager_forward", ()))

        def timed_execute(so, *a, **k):
            plan, start, forwards = planned(so), self._event(), eager_forwards()
            out = execute(so, *a, **k)
            self.launched.append((plan, eager_forwards() > forwards))
            if start is not None:
                self.device.append((plan, start, self._event()))
            self.finished.append((index(), plan))
            return out

        def timed_launch(so, *a, **k):
            plan, start, forwards = planned(so), self._event(), eager_forwards()
            pending = launch(so, *a, **k)
            self.launched.append((plan, eager_forwards() > forwards))
            if start is not None:
                self.device.append((plan, start, self._event()))
            if pending is None:  # nothing samples: done with its launch
                self.finished.append((index(), plan))
            else:
                self.pending[id(pending)] = (pending, plan)
            return pending

        def timed_collect(pending, *a, **k):
            out = collect(pending, *a, **k)
            self.finished.append((index(), self.pending.pop(id(pending), (None, None))[1]))
            return out

        self._patch(sched, "schedule", timed_schedule)
        self._patch(ex, "execute_model", timed_execute)
        self._patch(ex, "launch", timed_launch)
        self._patch(ex, "collect", timed_collect)
        if self.runner is not None:
            self._patch(self.runner, "_forward")
            _wrap_timer(self.runner, "_forward", "eager_forward", self.timers)
        self._patch(self.engine, "step")
        _wrap_timer(self.engine, "step", "step", self.timers)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, prev in reversed(self._saved):
            if prev is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, prev)
        self._saved.clear()

    def summary(self, costs: "Costs | None") -> dict:
        """Per kind: engine steps, their seconds (and share of all steps'), ms per step (mean,
        median, p90), tokens per step (prefill tokens, decode requests), how many of them ran their
        forward eagerly (in-process executors: the others replayed a CUDA graph), and where known the
        device time of the scheduled steps of that kind and the floor (Costs.step_s)."""
        if self.events:
            torch.cuda.synchronize()
        done: dict[int, list[tuple]] = {}
        for i, plan in self.finished:
            if plan is not None:
                done.setdefault(i, []).append(plan)
        rows: dict[str, dict] = {}
        for i, t in enumerate(self.timers.get("step", [])):
            plans = done.get(i)
            kind = "launch_only" if not plans else _kind(tuple(map(sum, zip(*plans))))
            r = rows.setdefault(kind, {"times": [], "prefill": 0, "decodes": 0, "floor": 0.0})
            r["times"].append(t)
            for p in plans or ():
                r["prefill"] += p[0]
                r["decodes"] += p[1]
                if costs is not None:
                    r["floor"] += costs.step_s(p[0] + p[1], p[2], p[3], p[4])
        eager: dict[str, int] = {}
        for plan, ran_eagerly in self.launched:
            if plan is not None:
                eager[_kind(plan)] = eager.get(_kind(plan), 0) + ran_eagerly
        device: dict[str, list[float]] = {}
        for plan, start, end in self.device:
            if plan is not None:
                device.setdefault(_kind(plan), []).append(start.elapsed_time(end) / 1e3)
        all_s = sum(sum(r["times"]) for r in rows.values())
        out = {}
        for kind in (*STEP_KINDS, "launch_only"):
            if kind not in rows:
                continue
            r, times = rows[kind], sorted(rows[kind]["times"])
            n, total = len(times), sum(times)
            row = {"steps": n, "total_s": total, "share_of_step_time": total / all_s if all_s else None,
                   "mean_ms": 1e3 * total / n, "median_ms": 1e3 * times[n // 2],
                   "p90_ms": 1e3 * times[min(n - 1, int(0.9 * n))],
                   "tokens_per_step": (r["prefill"] + r["decodes"]) / n,
                   "prefill_tokens_per_step": r["prefill"] / n, "decode_requests_per_step": r["decodes"] / n}
            if self.runner is not None and kind != "launch_only":  # of this kind's launched steps
                row["eager_steps"] = eager.get(kind, 0)
            if kind in device:
                d = device[kind]
                row.update(device_steps=len(d), device_s=sum(d), device_mean_ms=1e3 * sum(d) / len(d))
            if costs is not None and kind != "launch_only":
                row.update(floor_s=r["floor"], floor_over_time=r["floor"] / total if total else None)
                if kind in device:
                    row["floor_over_device"] = r["floor"] / row["device_s"] if row["device_s"] else None
            # floors to 6 significant digits (a tiny model's are microseconds), the rest to 4 decimals
            out[kind] = {k: (float(f"{v:.6g}") if k == "floor_s" else round(v, 4)) if isinstance(v, float) else v
                         for k, v in row.items()}
        return out


def _sync(llm: LLM) -> None:
    if llm.llm_engine.core.device.type == "cuda":
        torch.cuda.synchronize()


def mixed_traffic(llm: LLM, num_prompts: int = 400, input_len: int = 512, output_len: int = 128,
                  range_ratio: float = 0.75, seed: int = 5, warmup: int = 128, temperature: float = 0.0,
                  profiled: bool = False) -> dict:
    """Real traffic offline: num_prompts requests of their own input and output lengths (drawn as
    `moe bench throughput --random-range-ratio` draws them; greedy, ignore_eos) in one
    LLM.generate, timed whole and per engine step by kind (StepKinds); temperature > 0 samples
    (top_p 0.95, seeded) instead of greedy; profiled adds the CUDA kernels' table of the timed run
    (its times then include the profiler's cost). A warm-up first on other
    prompts of the same lengths (16 tokens each), so the kernels of every step shape compile
    outside the timed run and no timed prompt is in the prefix cache."""
    engine = llm.llm_engine
    vocab = min(129000, engine.model_config.vocab_size)  # below every benchmarked model's vocabulary
    requests = random_token_requests(num_prompts, input_len, output_len, vocab, seed, range_ratio)
    lengths = [(len(p["prompt_token_ids"]), n) for p, n in requests]
    warm = random_token_requests(min(warmup, num_prompts), input_len, output_len, vocab, seed + 1, range_ratio)
    llm.generate([p for p, _ in warm], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    sampled = {} if temperature == 0 else {"top_p": 0.95}
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i if temperature else None,
                             **sampled) for i, (_, n) in enumerate(requests)]
    _sync(llm)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if profiled else None
    with StepKinds(llm) as kinds, prof or contextlib.nullcontext():
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
        _sync(llm)
        elapsed = time.perf_counter() - t
    table = {}
    if prof is not None:
        table = {"top_kernels": prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25,
                                                          max_name_column_width=70)}
        print(table["top_kernels"], flush=True)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    costs = Costs.of(llm)
    max_num_seqs = engine.scheduler.config.max_num_seqs
    floor = costs.lengths_run_s(lengths, max_num_seqs) if costs else None
    steps = kinds.summary(costs)
    step_s = sum(r["total_s"] for r in steps.values())
    # The floors of the steps this schedule ran, summed: floor_s assumes every output token in a full batch, which
    # no first-come-first-served schedule of these lengths reaches; floor_s / steps_floor_s is the floor_over_time
    # the engine would score with every step at its own floor.
    steps_floor = sum(r.get("floor_s", 0.0) for r in steps.values()) if costs else None

    def spread(xs: list[int]) -> dict:
        return {"min": min(xs), "mean": round(sum(xs) / len(xs), 1), "max": max(xs)}

    return {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len, "range_ratio": range_ratio,
            "seed": seed, "temperature": temperature, "input_lens": spread([a for a, _ in lengths]),
            "output_lens": spread([b for _, b in lengths]),
            "total_prompt_tokens": prompt_tokens, "total_output_tokens": generated, "elapsed_s": elapsed,
            "requests_s": len(outs) / elapsed, "output_tok_s": generated / elapsed,
            "total_tok_s": (prompt_tokens + generated) / elapsed, "floor_s": floor,
            "floor_over_time": floor and floor / elapsed, "steps_floor_s": steps_floor,
            "floor_over_steps_floor": floor / steps_floor if steps_floor else None,
            "async_scheduling": engine.core.async_scheduling,
            "max_num_seqs": max_num_seqs, "engine_steps": sum(r["steps"] for r in steps.values()),
            "step_time_s": step_s, "outside_steps_s": elapsed - step_s, "steps": steps, **table}


def _start_decoding(llm: LLM, num_requests: int, prompt_len: int, max_tokens: int) -> None:
    """Add num_requests prompts and step until every one of them is decoding, with at least max_tokens
    tokens still to generate each: the first prompts decode while the later ones prefill, so each asks
    max_tokens plus one token a step of that prefill (else they finish inside a caller's timed window)."""
    engine = llm.llm_engine
    prefill_steps = -(-num_requests * prompt_len // engine.scheduler.config.max_num_batched_tokens) + 2
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens + prefill_steps, ignore_eos=True)
    for i, p in enumerate(_prompts(num_requests, prompt_len, seed=4)):
        engine.add_request(f"p{i}", p, params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running):
        engine.step()


def _replay_ms(graphs, size: int, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graphs.replay(size)
    start.record()
    for _ in range(replays):
        graphs.replay(size)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def graph_replay(llm: LLM, num_requests: int, prompt_len: int = 512) -> dict:
    """GPU time of the decode graph of num_requests running requests, replayed back to back: the
    forward alone, steadier than a step's wall time for A/B runs of changes inside the graph.
    Median and spread of 7 rounds of 30 replays."""
    _start_decoding(llm, num_requests, prompt_len, max_tokens=16)
    graphs = llm.llm_engine.executor.runner.graphs
    b = graphs.padded_size(num_requests)
    rounds = sorted(_replay_ms(graphs, b, 30) for _ in range(7))
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    return {"num_requests": num_requests, "graph_size": b, "replay_gpu_ms": round(rounds[3], 4),
            "min_ms": round(rounds[0], 4), "max_ms": round(rounds[-1], 4)}


def profile_decode(llm: LLM, num_requests: int, prompt_len: int = 512, steps: int = 12) -> dict:
    """Host time per engine part over decode-only steps, GPU time of the graph replay alone, and
    the top CUDA kernels of one eager decode step."""
    engine = llm.llm_engine
    runner = engine.executor.runner
    _start_decoding(llm, num_requests, prompt_len, max_tokens=steps + 8)
    timers: dict[str, list[float]] = {}
    for obj, name, key in ((engine.scheduler, "schedule", "schedule"),
                           (engine.scheduler, "update_from_output", "update"),
                           (runner, "_update_states", "runner_states"),
                           (runner, "_run_batch", "forward_launch"), (runner, "_sampling_batch", "sampling_batch"),
                           (engine.executor, "execute_model", "execute_model"), (engine, "step", "engine_step")):
        _wrap_timer(obj, name, key, timers)
    for _ in range(steps):
        engine.step()
    out = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in timers.items()}
    b = runner.graphs.padded_size(num_requests) if runner.graphs is not None else None
    if b is not None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        runner.graphs.replay(b)
        out["graph_launch_host"] = 1e3 * (time.perf_counter() - t)
        out["graph_replay_gpu"] = _replay_ms(runner.graphs, b, 10)
        # The kernels inside the replay: their summed time against the replay's tells the gaps.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                runner.graphs.replay(b)
            torch.cuda.synchronize()
        events = prof.key_averages()
        out["graph_kernels_gpu"] = sum(e.self_device_time_total for e in events) / 3e3
        out["graph_kernel_launches"] = sum(e.count for e in events if e.self_device_time_total > 0) / 3
        out["top_kernels_graph"] = events.table(sort_by="self_cuda_time_total", row_limit=24,
                                                max_name_column_width=60)
        print(out["top_kernels_graph"], flush=True)
    graphs, runner.graphs = runner.graphs, None  # one eager step under the profiler
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    runner.graphs = graphs
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table, flush=True)
    out["top_kernels"] = table
    while engine.has_unfinished_requests():
        engine.step()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def _mixed_steps(engine, prefix: str, steps: int, chunk: int, seed: int) -> None:
    """`steps` engine steps, each after adding a new `chunk`-token prompt (one token out) beside the running
    decodes: the mixed steps of host_parts and host_profile."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = _prompts(steps, chunk, seed=seed)
    for i in range(steps):
        engine.add_request(f"{prefix}{i}", prompts[i], one)
        engine.step()


def host_parts(llm: LLM, num_decodes: int = 256, chunk: int = 512, prompt_len: int = 512, steps: int = 24) -> dict:
    """Host time of each part of an engine step (median ms per step, perf_counter around each
    part; a part run twice in a step counts both), over `steps` decode-only steps of num_decodes
    running requests and over as many mixed steps (num_decodes - 1 decodes beside a new `chunk`-token
    prompt each), async scheduling as configured. The parts nest: `engine_step` holds the core step
    and the output side; `launch` holds build, upload, pending-token fill, replay or forward,
    logits and sampling inputs (`upload` holds upload_wait, the wait for the last upload's copies,
    upload_tables and upload_copy; `sample_deferred` the sampler's launch and the step's read-back
    copies; no logits_launch where the graphs hold the LM head); `collect` waits for
    the tokens of the step before. `gc` counts the
    garbage collector's passes in the timed steps (all, and full ones) with their total and
    longest ms (moe.gc_freeze keeps the start-up heap out of them)."""
    import gc

    import moe.worker.model_runner as mr
    engine = llm.llm_engine
    core = engine.core
    runner = engine.executor.runner
    timers: dict[str, list[float]] = {}
    originals = []

    def wrap(obj, name, key):
        originals.append(_wrap_timer(obj, name, key, timers))

    for obj, name, key in ((engine, "step", "engine_step"), (core, "step", "core_step"),
                           (engine.output, "process", "output_side"), (engine.scheduler, "schedule", "schedule"),
                           (engine.scheduler, "update_from_output", "update_from_output"),
                           (runner, "_update_states", "runner_states"), (runner, "launch", "launch"),
                           (runner, "collect", "collect"), (mr.StepBatch, "build", "batch_build"),
                           (mr, "upload", "upload"), (runner, "_check_pending", "pending_check"),
                           (runner, "_input_ids", "pending_ids"),
                           (runner, "_sampling_batch", "sampling_inputs"), (mr, "sample", "sample_launch"),
                           (runner.model, "compute_logits", "logits_launch")):
        wrap(obj, name, key)
    if runner.buffers is not None:  # inside upload: the wait for the last upload's copies, and the copies
        for name, key in (("begin", "upload_wait"), ("stage_table_writes", "upload_tables"), ("upload", "upload_copy")):
            wrap(runner.buffers, name, key)
    wrap(runner, "sample_deferred", "sample_deferred")
    for graphs, key in ((runner.graphs, "decode_graph_replay"), (runner.mixed_graphs, "mixed_graph_replay")):
        if graphs is not None:
            wrap(graphs, "replay", key)

    pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - gc_start[0]))

    def per_step(run_steps) -> dict:
        timers.clear()
        pauses.clear()
        gc.callbacks.append(on_gc)
        try:
            run_steps()
        finally:
            gc.callbacks.remove(on_gc)
        n = len(timers.get("engine_step", [])) or 1
        out = {k: round(1e3 * sum(v) / n, 4) for k, v in sorted(timers.items())}
        out["gc"] = {"passes": len(pauses), "full_passes": sum(g == 2 for g, _ in pauses),
                     "total_ms": round(1e3 * sum(t for _, t in pauses), 3),
                     "max_ms": round(1e3 * max((t for _, t in pauses), default=0.0), 3)}
        return out

    try:
        _start_decoding(llm, num_decodes, prompt_len, max_tokens=4 * steps + 40)
        for _ in range(4):
            engine.step()
        out = {"decode": per_step(lambda: [engine.step() for _ in range(steps)])}
        engine.abort_request(["p0"])  # a free seat (max_num_seqs): each new prompt gets in beside the decodes
        _mixed_steps(engine, "host-warm-up", steps, chunk, seed=9)  # new prompts, their sizes
        out["mixed"] = per_step(lambda: _mixed_steps(engine, "host-timed", steps, chunk, seed=10))
        out["steps_each"] = steps
    finally:
        for obj, name, orig in reversed(originals):
            if orig is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, orig)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def host_profile(llm: LLM, num_decodes: int = 256, chunk: int = 512, prompt_len: int = 512, steps: int = 24) -> dict:
    """Where the host's time goes inside engine steps, by function: cProfile over `steps` decode-only
    steps of num_decodes running requests, then over as many mixed steps (a new `chunk`-token prompt
    beside the decodes each), as host_parts runs them. Per kind, the 30 functions of most own time and
    the 30 of most cumulative time, in ms per step (cProfile's own overhead inflates both, most for
    code of many small calls: read them as shares, host_parts as times)."""
    import cProfile
    import pstats

    engine = llm.llm_engine

    def top(profile: cProfile.Profile, key: int) -> list:
        stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, prim calls, own s, cumulative s, callers)}
        rows = sorted(stats.items(), key=lambda kv: -kv[1][key])[:30]
        return [[f"{Path(f).name}:{line}({name})", calls, round(1e3 * own / steps, 4), round(1e3 * cum / steps, 4)]
                for (f, line, name), (calls, _, own, cum, _) in rows]

    def profiled(run_steps) -> dict:
        profile = cProfile.Profile()
        profile.enable()
        try:
            run_steps()
        finally:
            profile.disable()
        return {"by_own_ms": top(profile, 2), "by_cumulative_ms": top(profile, 3),
                "columns": ["function", "calls", "own ms/step", "cumulative ms/step"]}

    _start_decoding(llm, num_decodes, prompt_len, max_tokens=4 * steps + 40)
    for _ in range(4):
        engine.step()
    out = {"decode": profiled(lambda: [engine.step() for _ in range(steps)])}
    engine.abort_request(["p0"])  # a free seat, as host_parts
    _mixed_steps(engine, "hostprof-warm-up", steps, chunk, seed=11)
    out["mixed"] = profiled(lambda: _mixed_steps(engine, "hostprof-timed", steps, chunk, seed=12))
    out["steps_each"] = steps
    while engine.has_unfinished_requests():
        engine.step()
    return out


def step_timeline(llm: LLM, num_requests: int, prompt_len: int = 512, steps: int = 10) -> dict:
    """Where a decode step's wall time goes on the GPU (async scheduling as configured): over
    `steps` steps under the profiler, the union of the device's busy intervals (kernels and
    copies; PDL's overlapping kernels counted once) against the wall time, and the kernels that
    run fewer than 3 times a step (outside the layers: the LM head, sampling, input copies), and
    how many of the steps ran their forward eagerly rather than from the decode graphs."""
    from torch.autograd import DeviceType

    engine = llm.llm_engine
    _start_decoding(llm, num_requests, prompt_len, max_tokens=steps + 12)
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    forwards: dict[str, list[float]] = {}
    runner = engine.executor.runner
    _wrap_timer(runner, "_forward", "eager", forwards)  # an eager step's forward; graph replays skip it
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = time.perf_counter() - t
            torch.cuda.synchronize()
    finally:
        del runner._forward  # the instance attribute _wrap_timer set: the method again
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, first, last, cur_s, cur_e = 0.0, spans[0][0], spans[-1][1], *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    per_step = [(e.key, e.count / steps, e.self_device_time_total / steps) for e in prof.key_averages()
                if e.self_device_time_total > 0 and e.count < 3 * steps]
    per_step.sort(key=lambda r: -r[2])
    running_at_end = len(engine.scheduler.running)  # the window is meant to hold all of them, each step
    while engine.has_unfinished_requests():
        engine.step()
    return {"num_requests": num_requests, "steps": steps, "eager_steps": len(forwards.get("eager", ())),
            "running_at_end": running_at_end,
            "wall_ms_per_step": 1e3 * wall / steps,
            "device_span_ms_per_step": (last - first) / 1e3 / steps, "device_busy_ms_per_step": busy / 1e3 / steps,
            "device_idle_ms_per_step": (last - first - busy) / 1e3 / steps,
            "outside_layers_us_per_step": [[k[:60], round(c, 2), round(us, 2)] for k, c, us in per_step[:14]]}


def mixed_step(llm: LLM, num_decodes: int = 255, chunk: int = 512, prompt_len: int = 512, rounds: int = 8) -> dict:
    """The mixed step of the #30 target: num_decodes running requests decoding beside one new
    prompt of `chunk` tokens, `rounds` times (each new prompt asks one token, so it leaves the
    batch after its prefill). Device time per step by kind (StepKinds) against the step's floor,
    then the kernels of one more such step under the profiler (graph replays included)."""
    engine = llm.llm_engine
    _start_decoding(llm, num_decodes, prompt_len, max_tokens=4 * rounds + 40)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = _prompts(rounds + 1, chunk, seed=9)

    def step_with_chunk(i: int) -> None:
        engine.add_request(f"chunk{i}", prompts[i], one)
        for _ in range(3):  # the step that holds the chunk, the one that reads its token, one decode
            engine.step()
    step_with_chunk(0)  # warm-up
    _sync(llm)
    with StepKinds(llm) as kinds:
        for i in range(1, rounds):
            step_with_chunk(i)
        _sync(llm)
    steps = kinds.summary(Costs.of(llm))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step_with_chunk(rounds)
        _sync(llm)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60)
    print(table, flush=True)
    while engine.has_unfinished_requests():
        engine.step()
    return {"num_decodes": num_decodes, "chunk": chunk, "rounds": rounds - 1, "steps": steps, "top_kernels": table}


def profile_prefill(llm: LLM, num_prompts: int = 16, prompt_len: int = 512) -> dict:
    """One prefill step of num_prompts x prompt_len tokens: wall time (median of 3, after a
    warm-up) and the top kernels of one more step under the profiler."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def one_step(seed: int) -> float:
        for i, p in enumerate(_prompts(num_prompts, prompt_len, seed=seed)):
            engine.add_request(f"f{seed}-{i}", p, params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    times = sorted(one_step(seed) for seed in range(10, 14))[:3]  # the slowest (the warm-up) dropped
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        one_step(20)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
    print(table, flush=True)
    step = times[1]
    floor = Costs(llm).prefill_s(num_prompts, prompt_len)
    return {"tokens": num_prompts * prompt_len, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
            "floor_over_time": floor / step, "top_kernels": table}


def qwen3(results: dict, eager: bool, runs: list[str], tp: int = 1, record: bool = True, tag_suffix: str = "") -> None:
    max_model_len = 4096
    kv_cache_dtype = os.environ.get("BENCH_KV_CACHE_DTYPE", "auto")  # fp8 / fp8_e5m2: the `engine-fp8` stage
    t0 = time.perf_counter()
    llm = LLM(_dummy_model(max_model_len), device="cuda", load_format="dummy", max_model_len=max_model_len,
              max_num_seqs=256, max_num_batched_tokens=8192, enable_prefix_caching=False, enforce_eager=eager,
              tensor_parallel_size=tp, record_expert_load=record, kv_cache_dtype=kv_cache_dtype,
              async_scheduling={"1": True, "0": False}.get(os.environ.get("BENCH_ASYNC_SCHEDULING", "")),  # A/B: `ab`
              enable_return_routed_experts=os.environ.get("BENCH_ROUTED_EXPERTS") == "1")  # its cost: `ab`
    tag = ("eager" if eager else "graphs") + ("" if tp == 1 else f"-tp{tp}") + ("" if record else "-norecord") \
        + ("" if kv_cache_dtype == "auto" else f"-kv-{kv_cache_dtype}") + tag_suffix \
        + (f"-{_qwen3_layers()}L" if _qwen3_layers() else "")
    results[f"qwen3/{tag}/start_s"] = time.perf_counter() - t0
    print(f"Qwen3-30B-A3B shape ({tag}) ready in {results[f'qwen3/{tag}/start_s']:.1f} s", flush=True)
    jobs = {
        "decode256": lambda: decode_step(llm, 256, 512, 32),
        "decode1": lambda: decode_step(llm, 1, 512, 64),  # TPOT at batch 1 as a step's period
        "decode32": lambda: decode_step(llm, 32, 512, 64),
        "decode64": lambda: decode_step(llm, 64, 512, 32),
        "decode128": lambda: decode_step(llm, 128, 512, 32),
        "tpot1": lambda: tpot(llm, 1, 512, 64),
        "tpot32": lambda: tpot(llm, 32, 512, 64),
        "tput_256x2048x512": lambda: throughput(llm, 256, 2048, 512, 256),
        "tput_1000x1024x256": lambda: throughput(llm, 1000, 1024, 256, 256),
        "profile256": lambda: profile_decode(llm, 256),
        "profile1": lambda: profile_decode(llm, 1),
        "timeline256": lambda: step_timeline(llm, 256),
        "host256": lambda: host_parts(llm),  # host ms per step by part, decode-only and mixed
        "hostprof256": lambda: host_profile(llm),  # the same steps under cProfile, by function
        "timeline1": lambda: step_timeline(llm, 1, steps=30),
        "replay1": lambda: graph_replay(llm, 1),
        "replay16": lambda: graph_replay(llm, 16),
        "replay32": lambda: graph_replay(llm, 32),
        "replay256": lambda: graph_replay(llm, 256),
        "prefill8192": lambda: profile_prefill(llm),
        "mixed": lambda: mixed_traffic(llm),  # 400 prompts, 512 / 128 tokens +-75%
        "mixed_step": lambda: mixed_step(llm),  # 255 decodes beside a 512-token chunk
        "mixed_sampled": lambda: mixed_traffic(llm, temperature=0.8),  # the same, sampled (top_p 0.95)
        "uniform": lambda: mixed_traffic(llm, num_prompts=256, range_ratio=0.0),  # 256 x 512 / 128, all at once
        "mixed_profiled": lambda: mixed_traffic(llm, profiled=True),  # with the CUDA kernels' table
    }
    for name in runs:  # "mixed#2": the same run again in this process (warm kernels)
        r = jobs[name.split("#")[0]]()
        results[f"qwen3/{tag}/{name}"] = r
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if not k.startswith("top_kernels")}
        print(f"qwen3 {tag} {name}: {json.dumps(shown)}", flush=True)
    if record:
        load = llm.get_expert_load()
        results[f"qwen3/{tag}/expert_load"] = {"tokens_per_layer": load.counts.sum(axis=1).tolist()[:4],
                                               "max_share": float(load.counts.max() / max(load.counts.sum(), 1))}
    llm.shutdown()


# Cut to what fits one H200 in bf16: 1 dense + 3 MoE layers (deepseek_cut(3) for an H100).
DEEPSEEK_V3_CUT = {**DEEPSEEK_V3, "num_hidden_layers": 4, "first_k_dense_replace": 1, "max_position_embeddings": 4096}


def deepseek_cut(layers: int) -> dict:
    return {**DEEPSEEK_V3_CUT, "num_hidden_layers": layers}


# Moonlight-16B-A3B's shape (moonshotai/Moonlight-16B-A3B's config.json), whole: DeepSeek-V3's architecture
# (MLA without a query LoRA, sigmoid router) at 27 layers of 64 experts top-6 and 2 shared, ~32 GB of bf16.
MOONLIGHT_16B = {
    **DEEPSEEK_V3, "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
    "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0, "rope_scaling": None,
}
LLAMA4_SCOUT_CUT = {
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "vocab_size": 202048,
    "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 8,
    "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
    "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "no_rope_layers": [1, 1, 1, 0] * 2,
    "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
    "use_qk_norm": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 200008,
}

# gpt-oss-20b's shape (openai/gpt-oss-20b's config.json), experts dequantised to bf16 (dummy weights).
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "attention_bias": True, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    "torch_dtype": "bfloat16", "eos_token_id": 200002,
}
MXFP4 = {"quantization_config": {"quant_method": "mxfp4"}}  # the hub's experts: kept MXFP4 on CUDA
GPT_OSS_120B = {**GPT_OSS_20B, **MXFP4, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
# GLM-4.5-Air's shape (zai-org/GLM-4.5-Air's config.json) cut to 8 layers: 1 dense + 7 MoE.
# Qwen3-Next-80B-A3B's shape (Qwen/Qwen3-Next-80B-A3B-Instruct's config.json) cut to half its depth (24 layers:
# 3 Gated DeltaNet layers to 1 gated attention layer, as the whole model): 160 GB of bf16 do not fit one H200.
QWEN3_NEXT_CUT = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 151645,
}
GLM_45_AIR_CUT = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "eos_token_id": 151329,
}
FAMILY_SHAPES = (("deepseek-v3-4L", DEEPSEEK_V3_CUT), ("llama4-scout-8L", LLAMA4_SCOUT_CUT),
                 ("gpt-oss-20b", GPT_OSS_20B), ("gpt-oss-20b-mxfp4", {**GPT_OSS_20B, **MXFP4}),
                 ("gpt-oss-120b-mxfp4", GPT_OSS_120B), ("glm-4.5-air-8L", GLM_45_AIR_CUT),
                 ("qwen3-next-24L", QWEN3_NEXT_CUT))
FAMILY_RUNS = ("decode64", "decode256", "tput_256x1024x128")


def qwen3_next_cut(layers: int) -> dict:
    """QWEN3_NEXT_CUT at another depth (a multiple of 4: 3 linear layers to 1 full one), e.g. 12 layers
    (~40 GB) for a GPU of 80 GB."""
    if layers < 4 or layers % 4:
        raise ValueError(f"the Qwen3-Next cut needs a multiple of 4 layers, got {layers}")
    return {**QWEN3_NEXT_CUT, "num_hidden_layers": layers,
            "layer_types": QWEN3_NEXT_CUT["layer_types"][:4] * (layers // 4)}


def families(results: dict, runs=FAMILY_RUNS, only: str | tuple[str, ...] | None = None,
             shapes=FAMILY_SHAPES) -> None:
    for name, cfg in shapes:
        if only and not name.startswith(only):
            continue
        path = tempfile.mkdtemp()
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        t0 = time.perf_counter()
        with LLM(path, device="cuda", load_format="dummy", max_model_len=4096, max_num_seqs=256,
                 max_num_batched_tokens=8192, enable_prefix_caching=False) as llm:
            results[f"{name}/start_s"] = time.perf_counter() - t0
            jobs = {"decode1": lambda: decode_step(llm, 1, 512, 64), "decode8": lambda: decode_step(llm, 8, 512, 48),
                    "decode64": lambda: decode_step(llm, 64, 512, 24),
                    "decode256": lambda: decode_step(llm, 256, 512, 40),
                    "tput_256x1024x128": lambda: throughput(llm, 256, 1024, 128, 256),
                    "mixed_step": lambda: mixed_step(llm), "mixed": lambda: mixed_traffic(llm),
                    "mixed_profiled": lambda: mixed_traffic(llm, profiled=True)}
            for key in runs:  # "mixed#2": the same run again in this process (warm kernels)
                r = results[f"{name}/{key}"] = jobs[key.split("#")[0]]()
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()
                         if not k.startswith("top_kernels")}
                print(f"{name} {key}: {json.dumps(shown)}", flush=True)
        torch.cuda.empty_cache()


def _structured_model(cfg: dict) -> str:
    """A dummy-weight checkpoint folder with a synthetic 150k byte-level BPE tokenizer (the grammar
    library's cost grows with the vocabulary; built as benchmarks/bench_grammar_mask.py builds it)."""
    from benchmarks.bench_grammar_mask import VOCAB, build_tokenizer

    path = tempfile.mkdtemp()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "eos_token_id": 0}, f)  # the tokenizer's <|endoftext|>
    build_tokenizer(min(VOCAB, cfg["vocab_size"])).save(os.path.join(path, "tokenizer.json"))
    return path


def structured_masks(results: dict, cfg: dict | None = None, device: str = "cuda", batches=(1, 32, 256),
                     input_len: int = 128, output_len: int = 48, backends=("guidance", "xgrammar")) -> None:
    """What grammar masks cost a decode step (#33): TPOT of B requests under a JSON schema against B
    plain ones, B = 1, 32, 256 (and 32 structured among 256), Qwen3-30B-A3B shape, dummy weights,
    default (async) scheduling. Each request's schema is an array of at least 64 five-field objects,
    so no grammar completes inside output_len; "maxLength" bounds the string field, llguidance's slow
    case. Host time of the bitmask fill per step beside (fill_bitmask + fill_deferred). Once
    per grammar library (structured_outputs_config backend), each in its own engine. First, the
    device's part alone: the mask's upload and the Triton kernel that applies it, CUDA events."""
    from moe.structured_output.manager import StructuredOutputManager

    if device == "cuda":
        mask_on_device(results, batches)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cfg = cfg or {**QWEN3_30B_A3B, "max_position_embeddings": 4096}
    t0 = time.perf_counter()
    path = _structured_model(cfg)
    results["structured/tokenizer_s"] = time.perf_counter() - t0
    fills: list[float] = []
    fill, fill_deferred = StructuredOutputManager.fill_bitmask, StructuredOutputManager.fill_deferred

    def timed(f, deferred: bool):
        """A step's fill: its scheduled rows, plus the rows deferred under async scheduling (filled
        after the previous step is collected, before the next step is scheduled)."""
        def wrapper(self, so):
            t = time.perf_counter()
            f(self, so)
            if deferred and fills:
                fills[-1] += time.perf_counter() - t
            else:
                fills.append(time.perf_counter() - t)
        return wrapper

    from moe.structured_output import xgrammar_backend

    if not xgrammar_backend.available():
        print("xgrammar does not import here: llguidance only", flush=True)
        backends = [b for b in backends if b != "xgrammar"]
    StructuredOutputManager.fill_bitmask = timed(fill, False)
    StructuredOutputManager.fill_deferred = timed(fill_deferred, True)
    try:
        for backend in backends:
            _structured_runs(results, path, backend, cfg, device, batches, input_len, output_len, fills, sync)
    finally:
        StructuredOutputManager.fill_bitmask, StructuredOutputManager.fill_deferred = fill, fill_deferred


def mask_on_device(results: dict, batches, vocab: int = 151936, iters: int = 50) -> None:
    """Upload of a [B, ceil(V/32)] int32 host bitmask (pinned staging, no sync) plus the apply kernel
    on fp32 logits [B, V], per step, CUDA events over iters steps."""
    import numpy as np

    from kernels.host_to_device import host_to_device
    from kernels.token_bitmask import apply_token_bitmask

    rng = np.random.default_rng(0)
    for b in batches:
        logits = torch.randn(b, vocab, device="cuda")
        mask = rng.integers(-2**31, 2**31 - 1, size=(b, (vocab + 31) // 32), dtype=np.int32)
        rows = np.arange(b, dtype=np.int64)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for timed in (False, True):
            start.record()
            for _ in range(iters):
                apply_token_bitmask(logits, host_to_device(rows, logits.device), host_to_device(mask, logits.device))
            end.record()
            torch.cuda.synchronize()
        row = {"batch": b, "vocab": vocab, "upload_and_apply_us": start.elapsed_time(end) * 1e3 / iters}
        results[f"structured/device/{b}"] = row
        print(f"structured device mask {b}: {json.dumps(row)}", flush=True)


def _structured_runs(results, path, backend, cfg, device, batches, input_len, output_len, fills, sync) -> None:
    from benchmarks.bench_grammar_mask import SCHEMAS
    from moe import StructuredOutputsParams

    with LLM(path, device=device, load_format="dummy", max_model_len=4096, max_num_seqs=256,
             max_num_batched_tokens=8192, enable_prefix_caching=False,
             structured_outputs_config={"backend": backend}) as llm:
        vocab = min(cfg["vocab_size"], 150_000)

        def params(kind: str | None, n: int) -> SamplingParams:
            so = None if kind is None else StructuredOutputsParams(
                json={"type": "array", "items": SCHEMAS[kind], "minItems": 64})
            return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=kind is None, structured_outputs=so)

        def run(batch: int, kinds: list, n: int) -> tuple[float, list[int]]:
            prompts = _prompts(batch, input_len, seed=4, vocab=vocab)
            sync()
            t = time.perf_counter()
            outs = llm.generate(prompts, [params(k, n) for k in kinds], use_tqdm=False)
            sync()
            return time.perf_counter() - t, [len(o.outputs[0].token_ids) for o in outs]

        cases = [(f"{kind or 'plain'}/{b}", b, [kind] * b) for b in batches
                 for kind in (None, "typical", "string_maxLength")]
        cases.append(("typical_32_of/256", 256, ["typical"] * 32 + [None] * 224))
        for name, batch, kinds in cases:
            run(batch, kinds, 2)  # warm: compiles the schema, fills the caches
            t1 = min(run(batch, kinds, 1)[0] for _ in range(2))
            del fills[:]
            tn, lengths = min(run(batch, kinds, output_len) for _ in range(2))
            per_token = (tn - t1) / (output_len - 1)
            row = {"batch": batch, "structured": sum(k is not None for k in kinds),
                   "tpot_ms": per_token * 1e3, "tokens": sorted(set(lengths)),
                   "fill_ms_per_step": 1e3 * statistics.median(fills) if fills else 0.0,
                   "fill_p90_ms_per_step": 1e3 * sorted(fills)[int(0.9 * len(fills))] if fills else 0.0}
            results[f"structured/{backend}/{name}"] = row
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            print(f"structured {backend} {name}: {json.dumps(shown)}", flush=True)


DP2EP_LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "dp2ep-ll-graphs": dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="low_latency"),
    "dp2ep-auto-graphs": dict(data_parallel_size=2, enable_expert_parallel=True),  # the default backend
    "dp2ep-ll-eager": dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="low_latency",
                           enforce_eager=True),
    "dp2ep-a2a-eager": dict(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="all_to_all"),
}


def dp2ep(results: dict) -> None:
    """Decode steps of DP=2 + EP layouts against TP=2, same shapes and requests (two GPUs)."""
    shapes = (("qwen3", {**QWEN3_30B_A3B, "max_position_embeddings": 4096}), ("deepseek-v3-4L", DEEPSEEK_V3_CUT))
    for name, cfg in shapes:
        path = tempfile.mkdtemp()
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        for layout, kwargs in DP2EP_LAYOUTS.items():
            t0 = time.perf_counter()
            with LLM(path, device="cuda", load_format="dummy", max_model_len=4096, max_num_seqs=256,
                     max_num_batched_tokens=8192, enable_prefix_caching=False, **kwargs) as llm:
                start_s = time.perf_counter() - t0
                runs = {"decode256": decode_step(llm, 256, 512, 24),
                        "decode32": decode_step(llm, 32, 512, 24)}  # 16 per replica: small chunks
            runs["decode256"]["start_s"] = start_s
            for key, r in runs.items():
                results[f"{name}/{layout}/{key}"] = r
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}
                print(f"{name} {layout} {key}: {json.dumps(shown)}", flush=True)
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stages", nargs="+",
                        choices=["parity", "qwen3", "qwen3-tp2", "eager", "families", "families-mixed",
                                 "deepseek-mixed", "new-families", "hybrid", "tp2", "recording", "dp2ep",
                                 "structured", "mla-mixed"])
    parser.add_argument("--checkpoints", nargs="*", default=[".gpu_ckpts/qwen3_moe", ".gpu_ckpts/deepseek_v3",
                                                             ".gpu_ckpts/llama4_mm"])
    parser.add_argument("--runs", nargs="*", default=["decode256", "tpot1", "tpot32", "tput_256x2048x512",
                                                      "tput_1000x1024x256"])
    parser.add_argument("--parity-batched-tokens", type=int, default=64,
                        help="parity: max_num_batched_tokens (512: whole prompts in one step)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="new-families, mla-mixed: the shapes whose names start so (e.g. gpt-oss-20b-mxfp4)")
    parser.add_argument("--hybrid-layers", type=int, default=24,
                        help="hybrid: the Qwen3-Next cut's depth (24 fits an H200; 12 an H100)")
    parser.add_argument("--deepseek-layers", type=int, default=4,
                        help="mla-mixed: the DeepSeek-V3 cut's depth (1 dense + MoE layers; 4 fits an H200, 3 an H100)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        for stage in args.stages:
            if stage == "parity":
                parity(results, args.checkpoints, batched_tokens=args.parity_batched_tokens)
            elif stage == "qwen3":
                qwen3(results, eager=False, runs=args.runs)
            elif stage == "qwen3-tp2":  # the qwen3 runs under tensor_parallel_size=2 alone (A/B rounds)
                qwen3(results, eager=False, runs=args.runs, tp=2)
            elif stage == "families":
                families(results)
            elif stage == "families-mixed":  # DeepSeek-V3 and Llama-4 cuts: the mixed-step runs
                families(results, ["mixed_step", "mixed"])
            elif stage == "deepseek-mixed":  # the DeepSeek-V3 cut alone, --runs of mixed / mixed_step
                families(results, args.runs, only="deepseek")
            elif stage == "new-families":  # the gpt-oss-20b and GLM-4.5-Air shapes: --runs given, else the family runs
                families(results, args.runs if "--runs" in (argv or sys.argv) else FAMILY_RUNS,
                         only=tuple(args.only or ("gpt-oss", "glm")))
            elif stage == "hybrid":  # the Qwen3-Next cut: --runs given, else the family runs
                shape = (f"qwen3-next-{args.hybrid_layers}L", qwen3_next_cut(args.hybrid_layers))
                families(results, args.runs if "--runs" in (argv or sys.argv) else FAMILY_RUNS, shapes=(shape,))
            elif stage == "mla-mixed":  # MLA's steps (--runs): the Moonlight-16B-A3B shape and the DeepSeek-V3 cut
                families(results, args.runs, only=tuple(args.only) if args.only else None,
                         shapes=(("moonlight-16b-a3b", MOONLIGHT_16B),
                                 (f"deepseek-v3-{args.deepseek_layers}L", deepseek_cut(args.deepseek_layers))))
            elif stage == "recording":  # expert-load recording on, off, on again (the spread)
                for i, record in enumerate((True, False, True, False)):
                    qwen3(results, eager=False, runs=["decode256", "tpot1"], record=record, tag_suffix=f"-{i // 2}")
            elif stage == "dp2ep":
                dp2ep(results)
            elif stage == "structured":
                structured_masks(results)
            elif stage == "tp2":
                parity(results, args.checkpoints[:1], tp=2)
                for tp in (1, 2):
                    qwen3(results, eager=False, runs=["decode256", "tput_256x2048x512"], tp=tp)
            else:
                qwen3(results, eager=True, runs=["decode256"])
    finally:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
