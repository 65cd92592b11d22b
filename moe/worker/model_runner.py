"""The model runner: keeps per-request token/block state, turns each SchedulerOutput into
batch tensors, runs the model, samples, and returns the new tokens.

It sees only SchedulerOutputs, so a multi-process executor can broadcast the same object to
every rank's runner.

Parallel ranks: every rank of a DP replica runs the same batch. With pipeline parallelism a
stage receives the previous stage's activations and sends its own on (models/parallel/pipeline.py); logits
come from the last stage (all its TP ranks take part in the vocab gather), and only the
replica's driver rank (last stage, TP rank 0) samples: sampling is done once and its tokens are
sent to the other ranks of the replica with the next step (`apply_sampled`), so every rank
appends exactly the tokens the driver drew, whatever the sampling parameters.

On CUDA the step's inputs go through reused pinned/device buffers (moe/worker/step_buffers.py,
moe/worker/step_inputs.py), attention runs the Triton kernels, and steps replay CUDA graphs captured at
start-up (moe/worker/cuda_graphs.py): decode-only steps by batch size, mixed steps by token count;
elsewhere fresh tensors feed the torch references.
Images: the encoder runs over the step's scheduled images and their features replace the image
tokens' embeddings (moe/multimodal/encoder_runner.py); such steps run eagerly.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from all2all import low_latency_for_auto
from kernels.attention import AttentionMetadata
from kernels.fla_gated_delta import fla_prefill_available
from kernels.host_to_device import host_to_device
from models.layers.attention import mixed_graph_max_tokens, use_triton_attention
from models.layers.moe import DispatchStep
from models.parallel.state import get_parallel_state, pp_recv, pp_send
from moe.expert_load.counters import ExpertLoadCounters
from moe.multimodal.encoder_runner import EncoderRunner
from moe.worker.block_tables import BlockTables
from moe.worker.cuda_graphs import GRAPH_LOGITS, MIXED_GRAPHS, StepGraphs, default_capture_sizes, default_mixed_sizes
from moe.worker.grammar_mask import grammar_mask_inputs
from moe.worker.prompt_logprobs import (PromptLogprobs, PromptLogprobsTracker, assemble_prompt_logprobs,
                                        stage_prompt_logprobs)
from moe.worker.routed_experts import RoutedExpertsCapture
from moe.worker.sampler import SamplingBatch, sample
from moe.worker.step_buffers import StepBuffers
from moe.worker.step_inputs import RequestState, StepBatch, buffer_metadata, host_metadata, upload
from scheduler import KVCacheGroup, SchedulerOutput
from scheduler.kv_cache_spec import RECURRENT_STATE

logger = logging.getLogger("moe.runner")


@dataclass
class TokenLogprobs:
    """Raw logprobs of one sampled token: the token's own, its rank, and the top-k."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # With the first sampled token of a request that asked for them (moe/worker/prompt_logprobs.py).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # enable_return_routed_experts: the step's routed expert ids [T, L, K] int16 in the batch's token
    # order (SchedulerOutput.num_scheduled_tokens), L = the MoE layers named by routed_layers.
    routed_experts: np.ndarray | None = None
    routed_layers: list[int] | None = None

    def attach_prompt_logprobs(self, outputs: list) -> list:
        """The scheduler's outputs of this step, with their requests' prompt logprobs set. They ride
        with the first token, so they reach the output side exactly when it does: a token the
        scheduler drops (its request aborted or preempted meanwhile) takes them along, and the
        runner scores the prompt again when it is recomputed."""
        if self.prompt_logprobs:
            for co in outputs:
                co.prompt_logprobs = self.prompt_logprobs.get(co.req_id)
        return outputs


class PendingStep:
    """A launched step whose sampled tokens (and logprobs) may still be on their way
    (ModelRunner.launch). On CUDA they are copied to pinned memory right after sampling, so waiting
    for them does not wait for a later step queued behind."""

    def __init__(self, batch: StepBatch, result, prompt_finals: dict | None = None,
                 routed: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """result None: a step that samples nothing here and only reports its routing (routed: the
        step's [T, L, K] routed ids and their layers)."""
        self.batch = batch
        self.sampled_B = result.sampled_B if result is not None else None
        # the runner rows whose tokens it samples
        self.sampled_rows_R = batch.sample_rows_R() if result is not None else np.zeros(0, dtype=np.int64)
        outputs = {} if result is None else {
            "sampled": result.sampled_B, "logprob": result.sampled_logprob_B, "rank": result.sampled_rank_B,
            "top_ids": result.logprob_ids_BK, "top_vals": result.logprob_vals_BK}
        self.routed_layers = None
        if routed is not None:
            outputs["routed"], self.routed_layers = routed
        self.prompt_starts: dict[str, int] = {}  # requests whose prompt logprobs come with this step
        if prompt_finals:
            prompt, self.prompt_starts = stage_prompt_logprobs(prompt_finals)
            outputs.update(prompt)
        self._outputs = {k: t for k, t in outputs.items() if t is not None}
        self._ready = None
        if any(t.is_cuda for t in self._outputs.values()):
            staged = {}
            for k, t in self._outputs.items():
                staged[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                staged[k].copy_(t, non_blocking=True)
            self._outputs = staged
            self._ready = torch.cuda.Event()
            self._ready.record()
        elif "routed" in self._outputs:  # the step buffer is reused by the next forward
            self._outputs["routed"] = self._outputs["routed"].clone()

    @functools.cached_property
    def sample_index(self) -> dict[str, int]:
        """Request id -> its row among the sampled tokens."""
        if self.sampled_B is None:
            return {}
        return {self.batch.req_ids[i]: j for j, i in enumerate(self.batch.sample_rows)}

    def lists(self) -> dict[str, list]:
        """The step's outputs as lists: sampled, and logprob / rank / top_ids / top_vals when asked;
        routed (the routed expert ids) as a numpy array."""
        if self._ready is not None:
            self._ready.synchronize()
        return {k: t.numpy() if k == "routed" else t.tolist() for k, t in self._outputs.items()}


class DeferredSampling:
    """A launched step's logits and sampling inputs, not yet sampled (ModelRunner.launch with
    so.deferred_grammar_ids): ModelRunner.sample_deferred makes it a PendingStep."""
    __slots__ = ("batch", "logits", "sampling", "sample_ids", "sample_rows_R", "prompt_finals", "routed")

    def __init__(self, batch: StepBatch, logits: torch.Tensor, sampling, sample_ids: list[str],
                 sample_rows_R: torch.Tensor, prompt_finals: dict | None,
                 routed: tuple[torch.Tensor, list[int]] | None = None) -> None:
        """sample_rows_R: the sampling sequences' runner rows on the device (where their tokens go
        in the runner's last-sampled tokens)."""
        self.batch, self.logits, self.sampling, self.sample_ids = batch, logits, sampling, sample_ids
        self.sample_rows_R, self.prompt_finals, self.routed = sample_rows_R, prompt_finals, routed


def _derived_seed(seed: int, output_index: int) -> int:
    # A seeded request's draw for its i-th token depends only on (seed, i): reproducible
    # across batch compositions and after preemption.
    return hash((seed, output_index)) & ((1 << 63) - 1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, block_size: int,
                 eos_token_ids: tuple[int, ...], vocab_size: int, enforce_eager: bool = True,
                 cudagraph_capture_sizes: list[int] | None = None, kv_cache_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.requests: dict[str, RequestState] = {}
        self.images = EncoderRunner(model, device)  # the vision encoder's side of a step
        self.block_tables: BlockTables | None = None  # made with the KV cache (its group count)
        # The newest sampled token of each runner row (BlockTables row), on the device: async
        # scheduling's pending input ids read it (`_input_ids`). Made with the KV cache.
        self.last_sampled_R: torch.Tensor | None = None
        # this step's sample rows / their runner rows on the device (_run_batch; step-buffer views made when asked)
        self._sample_idx: torch.Tensor | None = None
        self._step_sample_rows: torch.Tensor | None = None
        # The graphs' logits of the sampled rows (made with them on one rank: GRAPH_LOGITS), written
        # at every replay; _step_logits: this step's, when it replayed a graph.
        self.graph_logits: torch.Tensor | None = None
        self._step_logits: torch.Tensor | None = None
        self._graph_logit_rows = 0  # its rows (0: the graphs end at the hidden states)
        self.kv_caches: list[torch.Tensor] = []
        # The caches' storage dtype: the model's, or an FP8 one (kv_cache_dtype="fp8" / "fp8_e5m2",
        # EngineArgs.resolve_kv_cache_dtype), which holds twice a bf16 cache's blocks in its memory.
        self.kv_cache_dtype = kv_cache_dtype or self.kv_dtype
        unit_scales = all((getattr(a, "k_scale", 1.0), getattr(a, "v_scale", 1.0)) == (1.0, 1.0)
                          for a in model.attention_layers())
        if self.kv_cache_dtype == torch.float8_e4m3fn and unit_scales and get_parallel_state().rank == 0:
            logger.warning("kv_cache_dtype fp8 (e4m3) with KV-cache scales 1.0 (the checkpoint has none): K/V "
                           "beyond +-448 saturate; a checkpoint with k_scale / v_scale tensors avoids it")
        self.num_kv_blocks = 0  # blocks of the smallest KV-cache group (set with the cache)
        ps = get_parallel_state()
        self.is_driver = ps.is_driver
        self.pp_size, self.is_first_stage, self.is_last_stage = ps.pp_size, ps.is_first_pp_rank, ps.is_last_pp_rank
        # A replica without work still runs a one-token forward (MoE collectives span DP
        # replicas); its KV write goes to one extra block that the scheduler never hands out.
        self.reserve_dummy_block = ps.needs_dummy_batches
        self.dummy_blocks: list[int] | None = None  # per KV-cache group
        # The GPU path: step inputs through reused pinned/device buffers, Triton attention, and
        # CUDA graphs for decode-only steps (not across pipeline stages, nor with a token
        # dispatcher whose count exchange syncs with the host: under expert parallelism only the
        # fixed-capacity "low_latency" one, which "auto" is on CUDA, is captured, for steps whose
        # every replica fits it).
        self.gpu_inputs = use_triton_attention(torch.empty(0, device=device))
        ep = ps.enable_expert_parallel and ps.ep_size > 1
        self.graphs_need_capacity = ep and (ps.all2all_backend == "low_latency" or (
            ps.all2all_backend == "auto" and low_latency_for_auto(device.type)))
        graphs_ok = self.gpu_inputs and ps.pp_size == 1 and (not ep or self.graphs_need_capacity)
        if self.gpu_inputs and not enforce_eager and not graphs_ok:
            logger.info("CUDA graphs are off for pipeline parallelism, and for expert parallelism with "
                        "all2all_backend 'all_to_all' or 'allgather_reducescatter' (their count exchange "
                        "syncs with the host): steps run eagerly")
        self.state_group: int | None = None  # the recurrent KV-cache group's index (set with the cache)
        self.use_cuda_graphs = graphs_ok and not enforce_eager and device.type == "cuda"
        # Mixed steps of up to this many tokens replay graphs: where attention reads its whole layout
        # from device tensors (the unified kernel at any size, MLA while it runs every row absorbed)
        # and no token dispatcher sizes its work on the host. Larger steps run eagerly.
        self.mixed_graph_tokens = mixed_graph_max_tokens(model.attention_layers()) \
            if self.use_cuda_graphs and MIXED_GRAPHS and not ep else 0
        self.use_mixed_graphs = self.mixed_graph_tokens > 0
        # Attention that graphs only some mixed steps says which (MLA: those of little prefill attention).
        self.mixed_graph_fits = next((layer.mixed_graph_fits for layer in model.attention_layers()
                                      if hasattr(layer, "mixed_graph_fits")), None)
        if self.use_mixed_graphs and model.recurrent_layers() and fla_prefill_available():
            # fla-core's chunked prefill sizes its grid on the host (kernels/fla_gated_delta.py)
            self.use_mixed_graphs = False
            logger.info("Mixed steps run eagerly: linear-attention prefill uses fla-core's chunked kernel "
                        "(MOE_FLA_PREFILL=1)")
        self.cudagraph_capture_sizes = cudagraph_capture_sizes
        self.limits: tuple[int, int, int] | None = None  # max_num_seqs, max_model_len, max_num_batched_tokens
        self.buffers: StepBuffers | None = None
        self.graphs: StepGraphs | None = None  # decode-only steps, by batch size
        self.mixed_graphs: StepGraphs | None = None  # the others, by token count
        self.counters: ExpertLoadCounters | None = None  # set by the worker when expert load is recorded
        # enable_return_routed_experts: the step buffer of routed ids (set by the worker); TP rank 0 of
        # each pipeline stage reports its stage's layers (moe/worker/routed_experts.py).
        self.routed: RoutedExpertsCapture | None = None
        self.reports_routing = ps.tp_rank == 0
        self.dispatch_step = DispatchStep()  # sized by configure
        self.prompt_logprobs = PromptLogprobsTracker(self.is_last_stage, vocab_size)  # requests scoring their prompt

    def configure(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> None:
        """The engine's limits, which size the step buffers and the CUDA graphs."""
        self.limits = (max_num_seqs, max_model_len, max_num_batched_tokens)
        self.dispatch_step.capacity = max(max_num_seqs, max(self.cudagraph_capture_sizes or [1]))
        if self.counters is not None:
            self.counters.reserve(max(max_num_batched_tokens, max_num_seqs))
        if self.routed is not None:
            self.routed.reserve(max(max_num_batched_tokens, max_num_seqs + 1, max(self.cudagraph_capture_sizes or [1])))

    # ---- KV cache ----------------------------------------------------------------------
    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block in every attention layer's cache, at the cache's storage dtype (an FP8
        cache: one byte an element)."""
        total = 0
        for attn in self.model.attention_layers():
            shape = attn.kv_cache_shape(1, self.block_size)
            total += int(np.prod(shape)) * self.kv_cache_dtype.itemsize
        return total

    def recurrent_state_bytes(self, num_slots: int) -> int:
        """Bytes of the recurrent layers' state pools with num_slots slots (0 without such layers)."""
        return sum(int(np.prod(shape)) * dtype.itemsize for layer in self.model.recurrent_layers()
                   for shape, dtype in layer.state_shapes(num_slots).values())

    @property
    def kv_dtype(self) -> torch.dtype:
        """The model's dtype, that of the K/V it computes (the cache stores them as kv_cache_dtype)."""
        return next(self.model.parameters()).dtype

    def allocate_kv_cache(self, groups: int | list[KVCacheGroup]) -> None:
        """One zeroed cache tensor per attention layer, sized by its KV-cache group's block
        count (an int = one full-attention group of that many blocks)."""
        if isinstance(groups, int):
            groups = [KVCacheGroup(None, groups)]
        keys = [g.key for g in groups]
        self.kv_caches = []
        self.num_kv_groups = len(groups)
        self.requests.clear()  # their blocks belonged to the previous cache
        self.images.holding.clear()
        on_device = self.gpu_inputs and self.limits is not None  # the step buffers keep a device copy
        self.block_tables = BlockTables(len(groups), log_writes=on_device)
        # Rows are reused lowest-first, so they stay below the most requests held at once (max_num_seqs):
        # a CUDA graph's view of this tensor never needs it to grow (twice that, to spare).
        rows = max(64, 2 * self.limits[0] + 2 if self.limits else 0)
        self.last_sampled_R = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.graphs = self.mixed_graphs = self.graph_logits = None  # captured over the previous cache tensors
        # the scheduler's, in every group of blocks
        self.num_kv_blocks = min((g.num_blocks for g in groups if not g.recurrent), default=0)
        self.state_group = next((i for i, g in enumerate(groups) if g.recurrent), None)
        # The dummy batch writes to one extra block per group, never handed out by the scheduler.
        self.dummy_blocks = [g.num_blocks for g in groups] if self.reserve_dummy_block and groups[0].num_blocks \
            else None
        extra = 1 if self.dummy_blocks else 0
        for attn in self.model.attention_layers():
            key = getattr(attn, "kv_cache_key", None)
            group = keys.index(key) if key in keys else 0  # an unplanned local group: the full one
            attn.kv_group = group
            cache = torch.zeros(attn.kv_cache_shape(groups[group].num_blocks + extra, self.block_size),
                                dtype=self.kv_cache_dtype, device=self.device)
            attn.kv_cache = cache
            self.kv_caches.append(cache)
        recurrent = self.model.recurrent_layers()
        if recurrent and self.state_group is None:
            raise ValueError("the model has recurrent (linear-attention) layers but no KV-cache group of state slots "
                             "was planned for them")
        for layer in recurrent:  # zeroed state pools: a slot of the dummy batch's beyond the scheduler's
            slots = groups[self.state_group].num_blocks + extra
            for name, (shape, dtype) in layer.state_shapes(slots).items():
                setattr(layer, name, torch.zeros(shape, dtype=dtype, device=self.device))
        if on_device:
            max_num_seqs, max_model_len, max_tokens = self.limits
            sizes = self._capture_sizes()
            # The profiling forward packs the token budget into sequences of max_model_len; a mixed
            # step's graph has a padding sequence beyond max_num_seqs.
            max_seqs = max(max_num_seqs + self.use_mixed_graphs, max(sizes, default=1), -(-max_tokens // max_model_len))
            self.buffers = StepBuffers(self.device, max(max_tokens, max_seqs), max_seqs,
                                       -(-max_model_len // self.block_size) + 1, len(groups), runner_rows=rows)
            if self.counters is not None:  # the count of real rows goes up with the inputs: no fill launch
                self.counters.num_valid = self.buffers.dev_view("num_valid", 1)

    def _capture_sizes(self) -> list[int]:
        if not self.use_cuda_graphs or self.limits is None:
            return []
        return self.cudagraph_capture_sizes or default_capture_sizes(self.limits[0])

    def capture_cuda_graphs(self) -> None:
        """Capture the mixed and the decode forwards (after the KV cache is allocated; every rank
        of a tensor-parallel group captures the same sizes in the same order), in one memory pool."""
        sizes = self._capture_sizes()
        if not sizes or self.buffers is None or not self.kv_caches:
            return
        max_tokens = self.limits[2]
        if not self.use_mixed_graphs or self.mixed_graph_fits is not None or self.mixed_graph_tokens < max_tokens:
            self.warm_up_eager_steps()  # some mixed steps run eagerly
        mixed_sizes = default_mixed_sizes(min(max_tokens, self.mixed_graph_tokens)) if self.use_mixed_graphs else []
        self.graph_logits = None
        self._graph_logit_rows = max(sizes + [min(t, self.mixed_graph_seqs) for t in mixed_sizes]) \
            if GRAPH_LOGITS and get_parallel_state().tp_size == 1 else 0
        pool = None
        if self.use_mixed_graphs:
            self.mixed_graphs = StepGraphs(mixed_sizes)
            pool = self.mixed_graphs.capture(self._upload_mixed_padding, self._mixed_graph_forward, self.device,
                                             "mixed steps of tokens", pool)
        self.graphs = StepGraphs(sizes)
        self.graphs.capture(self._upload_padding, self._graph_forward, self.device, "decode batch sizes", pool)

    @torch.inference_mode()
    def warm_up_eager_steps(self) -> None:
        """Where mixed steps run eagerly (expert parallelism; MLA's of much prefill attention), compile
        their kernels now rather than inside the first requests' steps: Triton compiles a variant per expert
        config bucket and integer specialisation, seconds each (measured on DeepSeek-V3: ~18 s
        of the first 400 mixed requests). One forward per mixed-graph token count (three short
        of it: real steps rarely are multiples of 16), at the full budget and two with short
        chunks, seven decode rows beside the chunks each, through blocks no request holds yet, not
        counted as expert load. Collective under TP / EP: every rank runs the same steps in the
        same order."""
        _, max_model_len, max_tokens = self.limits
        blocks = self.num_kv_blocks
        # every sequence reads blocks 0 .. cdiv(chunk + 1, S) - 1; a decode row sits at position chunk
        max_chunk = min(max_model_len - 1, blocks * self.block_size - 1)
        sizes = {t - 3 if t > 64 else t for t in default_mixed_sizes(max_tokens, fine=False)} | {max_tokens}
        # chunks of 16 and 32 tokens: the varlen prefill kernel's smaller tiles (MLA)
        sizes = sorted(t for t in sizes | {t for t in (7 + 16, 7 + 32) if t < max_tokens} if t >= 8)
        start = time.perf_counter()
        for t in sizes if max_chunk >= 1 else ():
            self.dispatch_step.max_tokens = t  # every rank runs the same steps
            self._run_batch(StepBatch.warm_up(t, 7, max_chunk, self.block_size, self.num_kv_groups), counted=False)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("Warmed up eager steps of %s tokens in %.1f s", sizes, time.perf_counter() - start)

    @property
    def mixed_graph_seqs(self) -> int:
        """Sequences of every mixed-step graph: the most a step has, and one for padding tokens."""
        return self.limits[0] + 1

    def _upload_padding(self, b: int) -> None:
        """b padding decode rows into the step buffers (what a graph is captured over)."""
        upload(self.buffers, StepBatch.empty(self.num_kv_groups), self.block_size, padded=(b, b),
               num_valid=0 if self.counters is not None else None)

    def _upload_mixed_padding(self, t: int) -> None:
        """A mixed step's graph layout with t padding tokens and no real sequence."""
        upload(self.buffers, StepBatch.empty(self.num_kv_groups), self.block_size, padded=(t, self.mixed_graph_seqs),
               num_valid=0 if self.counters is not None else None)

    @torch.inference_mode()
    def _graph_forward(self, b: int) -> torch.Tensor:
        """The model on b decode rows read from the step buffers (what a graph captures)."""
        buf = self.buffers
        self.dispatch_step.max_tokens = b  # every rank captures the same sizes in the same order
        buf.gather_tables(b)
        meta = buffer_metadata(buf, self.num_kv_groups, b, b, 1, list(range(b + 1)), [1] * b, decode_only=True)
        self._attach_state(meta)
        input_ids = self._input_ids(buf.dev_view("input_ids", b), buf.dev_view("pending_src", b))
        return self._with_logits(self._forward(input_ids, buf.dev_view("positions", b), meta), b)

    @torch.inference_mode()
    def _mixed_graph_forward(self, t: int) -> torch.Tensor:
        """The model on a mixed step of t tokens read from the step buffers (what a graph captures:
        the attention kernels read only the device layout, not the host lists given here)."""
        buf, b = self.buffers, self.mixed_graph_seqs
        buf.gather_tables(b)
        meta = buffer_metadata(buf, self.num_kv_groups, t, b, t, [0] * (b + 1), [0] * b, decode_only=False,
                               host_lists=False)
        self._attach_state(meta)
        input_ids = self._input_ids(buf.dev_view("input_ids", t), buf.dev_view("pending_src", t))
        return self._with_logits(self._forward(input_ids, buf.dev_view("positions", t), meta), min(t, b))

    def _with_logits(self, hidden: torch.Tensor, rows: int) -> torch.Tensor:
        """A graph's forward ends with the logits of its first `rows` sample rows (the step buffers'
        sample_idx, padded with token 0 by upload) in graph_logits: a replay then needs no LM-head
        launch. The buffer is made outside the graphs' pool, by the first warm-up forward (not
        captured), at the most rows of any graph, so every graph writes the same memory. A replayed
        step that samples nothing (a prompt's middle chunk alone) computes them all the same."""
        if not self._graph_logit_rows or hidden is None:
            return hidden
        last = hidden.index_select(0, self.buffers.dev_view("sample_idx", rows))
        if self.graph_logits is None:
            probe = self.model.compute_logits(last[:1])
            self.graph_logits = torch.empty(self._graph_logit_rows, probe.shape[-1], dtype=probe.dtype,
                                            device=self.device)
        self.model.compute_logits(last, out=self.graph_logits[:rows])
        return hidden

    def release(self) -> None:
        """Drop the KV cache, the CUDA graphs (their memory pool) and the step buffers."""
        for attn in self.model.attention_layers():
            attn.kv_cache = None
        for layer in self.model.recurrent_layers():
            for name in layer.state_shapes(0):
                setattr(layer, name, None)
        self.kv_caches, self.graphs, self.buffers, self.last_sampled_R = [], None, None, None
        self.mixed_graphs = self.graph_logits = None
        self.requests.clear()
        self.images.holding.clear()
        self.prompt_logprobs.active.clear()

    def kv_cache_keys(self) -> list:
        """Per attention layer of this rank its KV-cache group key, then per recurrent layer
        RECURRENT_STATE (scheduler/kv_cache_spec.py)."""
        return ([getattr(attn, "kv_cache_key", None) for attn in self.model.attention_layers()]
                + [RECURRENT_STATE] * len(self.model.recurrent_layers()))

    # ---- one step ----------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        tables = self.block_tables
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                tables.remove(state.row)
                self.images.free(req_id, None)
                self.prompt_logprobs.drop(req_id)
        for req_id, index in so.free_encoder_inputs:
            self.images.free(req_id, self.requests.get(req_id), index)
        for new in so.scheduled_new_reqs:
            state = self.requests[new.req_id] = RequestState(list(new.token_ids), new.num_prompt_tokens,
                                                             new.sampling_params, tables.add(new.block_ids),
                                                             new.num_computed_tokens, new.mm_items)
            if state.row >= len(self.last_sampled_R):
                self._grow_last_sampled(state.row)
            self.prompt_logprobs.add(new.req_id, state)
        cached, requests = so.scheduled_cached_reqs, self.requests
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = requests[req_id]
            if new_blocks:  # () when no group added a block
                for group, ids in enumerate(new_blocks):
                    tables.extend(state.row, group, ids)
            state.num_computed_tokens = num_computed

    def _grow_last_sampled(self, row: int) -> None:
        if self.graphs is not None or self.mixed_graphs is not None:  # they read the tensor they captured
            raise RuntimeError(f"runner row {row} is past the {len(self.last_sampled_R)} rows the CUDA graphs "
                               "captured: more requests are held than max_num_seqs")
        grown = torch.zeros(2 * (row + 1), dtype=torch.int64, device=self.device)
        grown[:len(self.last_sampled_R)] = self.last_sampled_R
        self.last_sampled_R = grown
        if self.buffers is not None:  # the device block tables too
            self.buffers.grow_rows(len(grown))

    def _sampling_batch(self, states: list[RequestState], seq_lens: list[int] | np.ndarray,
                        req_ids: list[str] | None = None, prev: PendingStep | None = None) -> SamplingBatch:
        """seq_lens: each row's context after the step, so the token sampled now is output number
        seq_len - num_prompt_tokens (also with async scheduling, where token_ids lags; prev, the step
        in flight, then samples the newest token of such a row, req_ids[i])."""
        if all(s.plain_greedy for s in states):  # the common case: one pass, nothing to upload
            return SamplingBatch(temperature_B=None, top_k_B=None, top_p_B=None, min_p_B=None, seeds=None,
                                 all_greedy=True, max_num_logprobs=-1)
        seq_lens = seq_lens.tolist() if isinstance(seq_lens, np.ndarray) else seq_lens
        dev = self.device
        params = [s.params for s in states]
        num_out = [L - s.num_prompt_tokens for s, L in zip(states, seq_lens)]
        all_greedy = all(p.is_greedy for p in params)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        f32 = torch.float32
        batch = SamplingBatch(
            temperature_B=None if all_greedy else host_to_device([p.temperature for p in params], dev, f32),
            top_k_B=host_to_device(top_k, dev, torch.int64) if not all_greedy and any(top_k) else None,
            top_p_B=host_to_device(top_p, dev, f32) if not all_greedy and any(x < 1 for x in top_p) else None,
            min_p_B=host_to_device(min_p, dev, f32) if not all_greedy and any(min_p) else None,
            seeds=None if all_greedy else
            [None if p.seed is None else _derived_seed(p.seed, n) for p, n in zip(params, num_out)],
            all_greedy=all_greedy,
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        if any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params):
            V, B = self.vocab_size, len(states)
            counts = torch.zeros(B, V, dtype=f32, device=dev)
            prompt = torch.zeros(B, V, dtype=torch.bool, device=dev)
            # (row, token) of every output and every prompt token, uploaded once each
            out_ids = [np.asarray(s.token_ids[s.num_prompt_tokens:], dtype=np.int64) for s in states]
            prompt_ids = [np.asarray(s.token_ids[:s.num_prompt_tokens], dtype=np.int64) for s in states]
            for dst, ids, accumulate in ((counts, out_ids, True), (prompt, prompt_ids, False)):
                rows = np.repeat(np.arange(B, dtype=np.int64), [len(x) for x in ids])
                flat = host_to_device(np.stack([rows, np.concatenate(ids)]), dev)
                dst.index_put_((flat[0], flat[1]), torch.ones((), dtype=dst.dtype, device=dev), accumulate=accumulate)
            batch.output_counts_BV, batch.prompt_mask_BV = counts, prompt
            batch.repetition_penalty_B = host_to_device([p.repetition_penalty for p in params], dev, f32)
            batch.frequency_penalty_B = host_to_device([p.frequency_penalty for p in params], dev, f32)
            batch.presence_penalty_B = host_to_device([p.presence_penalty for p in params], dev, f32)
        banned = []
        for i, (p, n) in enumerate(zip(params, num_out)):
            if p.min_tokens and n < p.min_tokens:
                stops = ([] if p.ignore_eos else self.eos_token_ids) + list(p.stop_token_ids)
                banned += [(i, t) for t in stops]
        batch.banned_tokens = host_to_device(np.ascontiguousarray(np.array(banned, dtype=np.int64).T), dev) \
            if banned else None
        if any(p.logit_bias or p.allowed_token_ids or p._bad_words_token_ids for p in params):
            self._token_bias(batch, states, seq_lens, req_ids, prev)
        return batch

    def _token_bias(self, batch: SamplingBatch, states: list[RequestState], seq_lens: list[int],
                    req_ids: list[str] | None, prev: PendingStep | None) -> None:
        """allowed_token_ids, logit_bias and bad words as (row, token id, value) columns of one upload.
        A multi-token bad word bans its last token when the output so far ends with the rest; where
        the newest output token is still pending (async scheduling), the host matches the prefix
        up to it, and the device compares that token when it is known (pending_bans)."""
        allowed, added, pending = [], [], []
        for i, (s, L) in enumerate(zip(states, seq_lens)):
            p = s.params
            allowed += [(i, t, 0.0) for t in p.allowed_token_ids or ()]
            added += [(i, t, b) for t, b in (p.logit_bias or {}).items()]
            known = min(len(s.token_ids), L)  # context tokens on the host
            num_out = known - s.num_prompt_tokens
            src = prev.sample_index[req_ids[i]] if known < L and prev is not None else None
            for word in p._bad_words_token_ids or ():
                *prefix, last = word
                if not prefix:
                    added.append((i, last, float("-inf")))
                elif src is None:
                    if len(prefix) <= num_out and s.token_ids[known - len(prefix):known] == prefix:
                        added.append((i, last, float("-inf")))
                elif len(prefix) - 1 <= num_out and s.token_ids[known - len(prefix) + 1:known] == prefix[:-1]:
                    pending.append((i, last, src, prefix[-1]))  # prefix[-1] must be the pending token
        dev = self.device
        batch.num_allowed = len(allowed)
        if allowed or added:
            batch.token_bias = host_to_device(np.ascontiguousarray(np.array(allowed + added, dtype=np.float64).T), dev)
        if pending:
            batch.pending_bans = host_to_device(np.ascontiguousarray(np.array(pending, dtype=np.int64).T), dev)
            batch.pending_tokens = prev.sampled_B

    def apply_sampled(self, sampled: dict[str, list[int]]) -> None:
        """Append the tokens the replica's driver rank sampled last step (non-driver ranks)."""
        for req_id, tokens in sampled.items():
            state = self.requests.get(req_id)
            if state is not None:
                state.token_ids.extend(tokens)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 inputs_embeds: torch.Tensor | None = None):
        """The model on this rank's stage: final hidden states [T, D] on the last stage, None on
        the others (their activations went to the next stage). inputs_embeds: the first stage's
        input embeddings instead of the ids' (a step that reads image features)."""
        embeds = {} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        if self.pp_size == 1:
            out = self.model(input_ids, positions, meta, **embeds)
            if self.counters is not None:
                self.counters.count_pending()  # inside a graph capture too: replays count
            return out
        intermediate = None
        if not self.is_first_stage:
            intermediate = self.model.make_empty_intermediate_tensors(input_ids.shape[0], self.kv_dtype, self.device)
            pp_recv(intermediate)
        out = self.model(input_ids, positions, meta, intermediate_tensors=intermediate, **embeds)
        if self.counters is not None:
            self.counters.count_pending()
        if self.is_last_stage:
            return out
        pp_send(out)
        return None

    def _run_batch(self, batch: StepBatch, counted: bool = True, with_images: bool = False,
                   prev: PendingStep | None = None):
        """Hidden states of the batch's tokens (None off the last pipeline stage): a CUDA-graph
        replay for a decode-only step within the captured sizes, else an eager forward.
        counted: whether the expert-load counters count its tokens (not a dummy batch's).
        with_images: some request of the batch holds image features (this stage embeds them).
        prev: the step in flight whose sampled tokens are this batch's pending inputs (async)."""
        T, B = len(batch.input_ids_T), len(batch.req_ids)
        num_valid = None if self.counters is None else T if counted else 0  # a graph's padding rows: not counted
        self._step_logits = None
        self._check_pending(batch, prev)
        if self.buffers is None or not self.buffers.fits(T, B, batch.max_blocks()):
            if num_valid is not None:
                self.counters.set_num_valid(num_valid)
            meta = host_metadata(batch, self.device, self.block_size, device_fields=self.gpu_inputs)
            input_ids = host_to_device(batch.input_ids_T, self.device)
            if batch.pending_src_T is not None:
                input_ids = self._input_ids(input_ids, host_to_device(batch.pending_src_T, self.device))
            embeds = self.images.inputs_embeds(batch, input_ids) if with_images else None
            self._sample_idx = host_to_device(batch.sample_token_rows(), self.device)
            self._step_sample_rows = host_to_device(batch.sample_rows_R(), self.device) if batch.sample_rows \
                else None
            self._attach_state(meta, batch)
            return self._forward(input_ids, host_to_device(batch.positions_T, self.device), meta, embeds)
        graphs, padded = None, None
        if batch.decode_only and self.graphs is not None and not with_images and (
                not self.graphs_need_capacity or self.dispatch_step.max_tokens <= self.dispatch_step.capacity):
            graphs, size = self.graphs, self.graphs.padded_size(B)
            padded = None if size is None else (size, size)
        elif not batch.decode_only and self.mixed_graphs is not None and not with_images and (
                self.mixed_graph_fits is None or self.mixed_graph_fits(batch.num_tokens_B, batch.seq_lens_B)):
            graphs, size = self.mixed_graphs, self.mixed_graphs.padded_size(T)
            padded = None if size is None else (size, self.mixed_graph_seqs)
        meta = upload(self.buffers, batch, self.block_size, padded, metadata=padded is None, num_valid=num_valid)
        self._sample_idx = self._step_sample_rows = None  # views of the step buffers, made when asked
        if padded is not None:  # the graph reads the pending inputs itself
            hidden = graphs.replay(padded[0])[:T]
            self._step_logits = self.graph_logits
            return hidden
        input_ids = self.buffers.dev_view("input_ids", T)
        if batch.pending_src_T is not None:
            input_ids = self._input_ids(input_ids, self.buffers.dev_view("pending_src", T))
        embeds = self.images.inputs_embeds(batch, input_ids) if with_images else None
        self._attach_state(meta, batch)
        return self._forward(input_ids, self.buffers.dev_view("positions", T), meta, embeds)

    def _attach_state(self, meta: AttentionMetadata, batch: StepBatch | None = None) -> None:
        """The recurrent layers' inputs: each sequence's state slot (its one block of the recurrent
        group) and whether its state carries over (the step does not start at position 0). With the
        layout on the device (step buffers, CUDA graphs) both are computed there, and a padding
        sequence (context 0) gets slot -1: its state is read as zeros and written nowhere."""
        if self.state_group is None:
            return
        slots = meta.for_group(self.state_group).block_tables_BM[:, 0].long()
        if meta.seq_lens_t is not None:
            lens, qsl = meta.seq_lens_t, meta.query_start_loc_t
            meta.state_slots_B = torch.where(lens > 0, slots, -1)
            meta.has_initial_state_B = lens > qsl[1:] - qsl[:-1]
        else:
            meta.state_slots_B = slots.contiguous()
            meta.has_initial_state_B = host_to_device(batch.seq_lens_B > batch.num_tokens_B, self.device)

    @staticmethod
    def _check_pending(batch: StepBatch, prev: PendingStep | None) -> None:
        """Async scheduling: the batch's pending input ids are tokens that prev, the step in flight, samples."""
        if batch.pending_src_T is not None:
            batch.check_pending(None if prev is None else prev.sampled_rows_R)

    def _input_ids(self, input_ids_T: torch.Tensor, pending_src_T: torch.Tensor) -> torch.Tensor:
        """The step's input ids with the pending ones (pending_src_T >= 0) read from the last sampled
        token of that runner row, on the device: stream-ordered after the step in flight samples
        it. Inside the CUDA graphs too, over the step buffers' views."""
        sampled = self.last_sampled_R.index_select(0, pending_src_T.clamp(min=0))
        return torch.where(pending_src_T >= 0, sampled, input_ids_T)

    def _sample_rows_R(self, batch: StepBatch) -> torch.Tensor:
        """The step's sampling sequences' runner rows on the device."""
        if self._step_sample_rows is None:
            self._step_sample_rows = self.buffers.dev_view("sample_rows", len(batch.sample_rows))
        return self._step_sample_rows

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """One token at position 0 written to the reserved block: runs every collective of a
        forward (MoE dispatch/combine, TP, PP) without touching any request's state."""
        if self.dummy_blocks is None:
            raise RuntimeError("a dummy batch needs the reserved KV blocks (allocate_kv_cache first)")
        batch = StepBatch.one_token(self.dummy_blocks)
        self._run_batch(batch, counted=False)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, dummy: bool = False) -> ModelRunnerOutput:
        """Run one step. `dummy`: when `so` is empty, run a one-token forward anyway (another DP
        replica has work and the MoE collectives need every rank)."""
        pending = self.launch(so, dummy=dummy)
        return self.collect(pending) if pending is not None else ModelRunnerOutput()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, prev: PendingStep | None = None,
               dummy: bool = False) -> PendingStep | None:
        """Queue one step's forward and sampling without waiting for them; None when the step
        samples nothing here. prev: the step still in flight (async scheduling), whose sampled
        tokens feed this step's pending inputs."""
        self._update_states(so)
        if so.is_empty:
            if dummy:
                self.execute_dummy()
            return None
        batch = StepBatch.build(so, self.requests, self.block_tables, self.state_group)
        with_images = False
        if self.is_first_stage:  # images are embedded where the token embeddings are
            if so.scheduled_encoder_inputs:
                self.images.encode(so, self.requests, self.kv_dtype)
            with_images = bool(self.images.holding)
        hidden = self._run_batch(batch, with_images=with_images, prev=prev)
        routed = None
        if self.routed is not None and self.reports_routing:
            rows = self.routed.step_rows(len(batch.input_ids_T))
            routed = None if rows is None else (rows, self.routed.layers)
        # Prompt logprobs: the rows of this step that score prompt tokens (eager, after any graph replay).
        prompt_finals = self.prompt_logprobs.step(batch, hidden, self.model, self.is_driver) \
            if self.prompt_logprobs.active and hidden is not None else None
        sample_rows = batch.sample_rows
        if not sample_rows or hidden is None:
            return PendingStep(batch, None, routed=routed) if routed is not None else None
        if self._step_logits is not None:  # the graph's replay computed them
            logits = self._step_logits[:len(sample_rows)]
        else:
            if len(sample_rows) == hidden.shape[0]:  # every token samples (decode-only)
                last = hidden
            else:
                if self._sample_idx is None:
                    self._sample_idx = self.buffers.dev_view("sample_idx", len(sample_rows))
                last = hidden.index_select(0, self._sample_idx)  # uploaded with the step's inputs: no sync
            logits = self.model.compute_logits(last)  # a TP collective: every TP rank of the stage
        if not self.is_driver:
            return PendingStep(batch, None, routed=routed) if routed is not None else None
        sample_ids, sample_states = batch.sampling_requests
        seq_lens = batch.seq_lens_B if len(sample_rows) == len(batch.states) else batch.seq_lens_B[sample_rows]
        sampling = self._sampling_batch(sample_states, seq_lens, sample_ids, prev)
        deferred = DeferredSampling(batch, logits, sampling, sample_ids, self._sample_rows_R(batch), prompt_finals,
                                    routed)
        return deferred if so.deferred_grammar_ids else self.sample_deferred(deferred, so)

    @torch.inference_mode()
    def sample_deferred(self, step: "DeferredSampling", so: SchedulerOutput) -> PendingStep:
        """Sample a launched step with so's grammar bitmask: at once in launch, or (async
        scheduling, so.deferred_grammar_ids) once the engine core has filled the rows that waited for
        the step before. Queued behind the step's forward on the stream: no sync."""
        sampling = step.sampling
        if so.grammar_bitmask is not None:
            sampling.grammar_rows_R, sampling.grammar_bitmask_RW = grammar_mask_inputs(so, step.sample_ids,
                                                                                      self.device)
        result = sample(step.logits, sampling)
        # the tokens a next step's pending inputs read (async scheduling), in stream order before it
        self.last_sampled_R.index_copy_(0, step.sample_rows_R, result.sampled_B)
        return PendingStep(step.batch, result, step.prompt_finals, step.routed)

    def collect(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's tokens, append them to the request states, and return them."""
        batch, got = pending.batch, pending.lists()
        out = ModelRunnerOutput()
        if "routed" in got:
            out.routed_experts, out.routed_layers = got["routed"], pending.routed_layers
        if pending.sampled_B is None:  # a step that reports only its routing
            return out
        sampled = got["sampled"]
        want_logprobs = "logprob" in got
        if want_logprobs:
            lp, ranks = got["logprob"], got["rank"]
            top_ids, top_vals = got.get("top_ids"), got.get("top_vals")
        if pending.prompt_starts:
            out.prompt_logprobs = assemble_prompt_logprobs(got, pending.prompt_starts)
        sample_ids, sample_states = batch.sampling_requests  # made by launch: the same lists
        for state, token in zip(sample_states, sampled):
            state.token_ids.append(token)  # a state dropped meanwhile (finished, preempted) is unused
        out.sampled = {req_id: [token] for req_id, token in zip(sample_ids, sampled)}
        if want_logprobs:
            for j, (req_id, state) in enumerate(zip(sample_ids, sample_states)):
                k = state.params.logprobs
                if k is not None:
                    out.logprobs[req_id] = [TokenLogprobs(sampled[j], lp[j], ranks[j],
                                                          top_ids[j][:k] if top_ids else [],
                                                          top_vals[j][:k] if top_vals else [])]
        return out
