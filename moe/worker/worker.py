"""One rank's share of the model: build (only this rank's shard is allocated and loaded), size
the KV cache, run steps. Used in-process (one rank, or each torchrun rank) and as the body of a
spawned worker process (`worker_main`, driven over a pipe by moe.worker.parallel_executor).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pickle
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import batch_invariant
from models.config import ModelConfig
from models.fp8 import resolve_fp8_experts
from models.mxfp4 import resolve_mxfp4_experts
from models.layers.mla_attention import MLAAttention
from models.layers.moe import FusedMoE, MoEParallelConfig, attach_dispatch_step
from models.loader import init_dummy_weights, load_weights, update_weights
from models.parallel.state import get_parallel_state
from moe.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from moe.expert_load.counters import attach_expert_counters, moe_layer_index
from moe.gc_freeze import freeze_startup_heap
from moe.worker.cpu_memory import keep_freed_memory
from moe.worker.model_runner import ModelRunner, ModelRunnerOutput
from moe.worker.routed_experts import attach_routed_capture
from scheduler import KVCacheGroup, SchedulerOutput

logger = logging.getLogger("moe.worker.worker")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(model_cls: type, config: ModelConfig, model_path: str, args: EngineArgs,
                device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model of this rank (the process's ParallelState decides the shard)."""
    config = _with_fp8_experts_choice(model_cls, config, args, device)
    config = _with_mxfp4_experts_choice(config, args, device)
    eplb = args.eplb
    moe_parallel = MoEParallelConfig.from_parallel_state(
        kernel_backend=args.moe_backend, eplb_redundant_experts=eplb.num_redundant_experts if eplb else None)
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config, moe_parallel=moe_parallel)
    if args.load_format == "dummy":
        init_dummy_weights(model, seed=args.seed)
    else:
        load_weights(model, model_path, progress=_is_rank_zero())
    return model.eval()


def _with_fp8_experts_choice(model_cls: type, config: ModelConfig, args: EngineArgs,
                             device: torch.device) -> ModelConfig:
    """`config` with `fp8.keep_experts` decided for this device and these arguments (a copy: the
    engine's own config stays as parsed)."""
    fp8 = getattr(config, "fp8", None)
    keep = resolve_fp8_experts(fp8, args.quantization, device, args.moe_backend, args.load_format,
                               getattr(model_cls, "supports_fp8_experts", False))
    if fp8 is None or fp8.keep_experts == keep:
        return config
    config = copy.copy(config)  # keeps attributes set outside the fields (limit_positions)
    config.fp8 = dataclasses.replace(fp8, keep_experts=keep)
    return config


def _with_mxfp4_experts_choice(config: ModelConfig, args: EngineArgs, device: torch.device) -> ModelConfig:
    """`config` with `keep_mxfp4` decided for this device and these arguments (a copy), for models
    with MXFP4 checkpoints (gpt-oss); the quantization argument is checked for every model."""
    keep = resolve_mxfp4_experts(getattr(config, "mxfp4", False), args.quantization, device, args.moe_backend)
    if getattr(config, "keep_mxfp4", False) == keep:
        return config
    config = copy.copy(config)
    config.keep_mxfp4 = keep
    return config


def _is_rank_zero() -> bool:
    return get_parallel_state().rank == 0


@dataclass
class WorkerSpec:
    """Everything a rank needs to build its shard (picklable, sent to spawned workers)."""
    model_cls: type
    config: ModelConfig
    model_path: str
    args: EngineArgs
    device_type: str
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]


def refuse_batch_invariant(model: torch.nn.Module, config: ModelConfig) -> None:
    """batch_invariant has no invariant path for MLA attention or linear-attention layers yet."""
    what = ("MLA attention" if any(isinstance(a, MLAAttention) for a in model.attention_layers())
            else "linear-attention (recurrent) layers" if model.recurrent_layers() else None)
    if what:
        raise ValueError(f"batch_invariant is not supported for {config.architecture} ({what}): "
                         "it covers the GQA attention families")


class Worker:
    def __init__(self, spec: WorkerSpec, device: torch.device) -> None:
        self.spec, self.args, self.device = spec, spec.args, device
        if device.type == "cpu":
            keep_freed_memory()  # activations' pages reused, not faulted in per op (moe/worker/cpu_memory.py)
        torch.manual_seed(spec.args.seed)
        self.sleeping, self._asleep_weights = 0, {}  # sleep mode (sleep / wake_up): the level, the weights kept
        batch_invariant.set_enabled(spec.args.batch_invariant_on)  # process-wide: this rank's kernels
        self.model = build_model(spec.model_cls, spec.config, spec.model_path, spec.args, device, spec.dtype)
        if spec.args.batch_invariant_on:
            refuse_batch_invariant(self.model, spec.config)
        self.runner = ModelRunner(self.model, device, spec.args.block_size, spec.eos_token_ids,
                                  spec.config.vocab_size, enforce_eager=spec.args.enforce_eager,
                                  cudagraph_capture_sizes=spec.args.cudagraph_capture_sizes,
                                  kv_cache_dtype=spec.args.resolve_kv_cache_dtype(spec.dtype))
        # A fixed-capacity dispatcher (all2all_backend="low_latency") is sized to a decode batch
        # and told each step's largest replica batch (models/layers/moe.py DispatchStep).
        attach_dispatch_step(self.model, self.runner.dispatch_step)
        # Expert-load counters in every MoE layer (EPLB needs them); without expert parallelism
        # the TP ranks of a replica see the same tokens and only TP rank 0 counts.
        if spec.args.record_expert_load or spec.args.enable_eplb:
            self.runner.counters = attach_expert_counters(self.model, device,
                                                          counts_here=get_parallel_state().tp_rank == 0)
        if spec.args.enable_return_routed_experts:
            self.runner.routed = attach_routed_capture(self.model, device)

    # ---- KV cache ----------------------------------------------------------------------
    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """KV blocks this rank can hold (the executor takes the minimum over ranks)."""
        self.runner.configure(max_num_seqs, max_model_len, max_num_batched_tokens)
        per_block = max(self.runner.kv_cache_bytes_per_block(), 1)
        # Recurrent layers' state pools (a slot per running request and the dummy batch's) come out
        # of the same budget first.
        state = self.runner.recurrent_state_bytes(max_num_seqs + 1)
        args = self.args
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        if self.device.type == "cpu":
            if args.kv_cache_memory_bytes is not None:
                return max(args.kv_cache_memory_bytes - state, 0) // per_block
            # Never more than every sequence at full length could use (plus one block each).
            useful = max_num_seqs * (-(-max_model_len // args.block_size) + 1)
            return min(max(DEFAULT_CPU_KV_CACHE_BYTES - state, 0) // per_block, useful)
        if args.kv_cache_memory_bytes is not None:
            return max(args.kv_cache_memory_bytes - state, 0) // per_block
        return self._profile_gpu_blocks(per_block, max_model_len, max_num_batched_tokens, state)

    def _profile_gpu_blocks(self, per_block: int, max_model_len: int, max_num_batched_tokens: int,
                            state_bytes: int = 0) -> int:
        """Run one forward at the token budget, then give the KV cache what is left of
        total x gpu_memory_utilization after the weights, the peak activations and whatever
        else (other processes, the CUDA context) already holds. Collective: in a parallel
        layout every rank profiles at once."""
        from moe.worker.profiling import profile_forward

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        profile_forward(self.runner, max_num_batched_tokens, max_model_len)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        available = total * self.args.gpu_memory_utilization - (total - free) - peak_extra - state_bytes
        logger.info("Memory profiling: total %.2f GiB, in use %.2f GiB, activation peak %.2f GiB, "
                    "recurrent state %.2f GiB, KV cache budget %.2f GiB", total / 2**30, (total - free) / 2**30,
                    peak_extra / 2**30, state_bytes / 2**30, max(available, 0) / 2**30)
        return max(int(available // per_block), 0)

    def initialize_cache(self, groups: list[KVCacheGroup]) -> None:
        """Allocate the KV cache, then capture the decode CUDA graphs over it (collective under
        tensor parallelism: every rank captures the same sizes)."""
        self._groups = groups  # for wake_up
        self.runner.allocate_kv_cache(groups)
        self.runner.capture_cuda_graphs()
        freeze_startup_heap()  # the rank is built (in a worker process, nothing else freezes its heap)

    # ---- weight updates and sleep mode ------------------------------------------------------
    def update_weights(self, named_tensors: list) -> int:
        """(Hugging Face name, tensor) pairs copied into this rank's parameters in place (its shards),
        so captured CUDA graphs stay valid. Returns the pieces this rank took."""
        if self.sleeping:
            raise RuntimeError("update_weights while the engine sleeps: call wake_up() first")
        return update_weights(self.model, named_tensors)

    def sleep(self, level: int) -> None:
        """Free the KV cache, the CUDA graphs and the step buffers; level 1 also moves the weights to
        host memory, level 2 drops them (wake_up then gives uninitialised ones for update_weights)."""
        self.runner.release()
        params = list(self.model.named_parameters())
        self._asleep_weights = {}
        for name, p in params:
            if level == 1 and self.device.type != "cpu":
                self._asleep_weights[name] = p.data.to("cpu")
            elif level == 2:
                self._asleep_weights[name] = (tuple(p.shape), p.dtype)
            else:  # level 1 on the CPU: the weights are in host memory already
                continue
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.sleeping = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Weights back (level 1) or allocated afresh (level 2), then the KV cache and the graphs."""
        for name, p in self.model.named_parameters():
            saved = self._asleep_weights.get(name)
            if isinstance(saved, torch.Tensor):
                p.data = saved.to(self.device)
            elif saved is not None:
                p.data = torch.empty(saved[0], dtype=saved[1], device=self.device)
        self._asleep_weights, self.sleeping = {}, 0
        self.initialize_cache(self._groups)

    # ---- expert load and EPLB -------------------------------------------------------------
    def expert_load_snapshot(self) -> dict | None:
        """This rank's cumulative expert counts (moe/expert_load/counters.py), None without MoE layers
        or recording."""
        counters = self.runner.counters
        return counters.snapshot() if counters is not None else None

    def apply_expert_placement(self, phys_to_log_by_layer: dict[int, list[int]]) -> int:
        """EPLB: install a placement in this rank's MoE layers (decoder-layer index -> the logical
        expert of each physical slot); collective over each layer's EP group. Returns the slots
        this rank received."""
        moved = 0
        for name, module in self.model.named_modules():
            if isinstance(module, FusedMoE) and module.eplb is not None:
                moved += module.apply_placement(phys_to_log_by_layer[moe_layer_index(name)])
        return moved

    # ---- steps -------------------------------------------------------------------------
    def execute(self, so: SchedulerOutput, prev_sampled: dict[str, list[int]] | None = None,
                dummy: bool = False, max_tokens: int | None = None,
                share_sampled: bool = False) -> ModelRunnerOutput | None:
        """One step of this rank's DP replica. `prev_sampled`: the tokens the replica's driver
        rank sampled last step (applied here on the other ranks). `max_tokens`: the most tokens
        any replica runs this step (for a fixed-capacity dispatcher). `share_sampled` (async
        scheduling under TP: the driver sends the next step before it has this one's tokens):
        the driver rank broadcasts its sampled tokens to the other ranks right after the step
        (one replica, one stage: the control group is the TP group). Returns the sampled tokens
        on the driver rank (and a stage's routed experts on its TP rank 0), None elsewhere."""
        if prev_sampled and not self.runner.is_driver:
            self.runner.apply_sampled(prev_sampled)
        if max_tokens is not None:
            self.runner.dispatch_step.max_tokens = max_tokens
        out = self.runner.execute_model(so, dummy=dummy)
        if share_sampled:
            state = get_parallel_state()
            shared = [out.sampled if self.runner.is_driver else None]
            dist.broadcast_object_list(shared, src=state.layout.driver_rank(0), group=state.cpu_group)
            if not self.runner.is_driver:
                self.runner.apply_sampled(shared[0])
        # the driver's tokens; TP rank 0 of another pipeline stage: its layers' routed experts
        return out if self.runner.is_driver or out.routed_experts is not None else None


# ---- the spawned worker process -------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    """Exit when the driver is gone (killed without a chance to stop us): no orphans."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def worker_main(rank: int, world_size: int, init_method: str, backend: str, spec: WorkerSpec,
                conn, parent_pid: int, num_threads: int) -> None:
    """Entry point of a spawned rank. Protocol over `conn` (pickled with send_bytes):
    driver -> worker (method, args) ; worker -> driver ("ok", result) or ("error", traceback).
    The first reply ("ok", None) says the shard is built; ("shutdown", ()) ends the loop."""
    import torch.distributed as dist

    from models.parallel.state import ParallelLayout, collective_timeout, init_parallel_state

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(num_threads)
    args = spec.args
    try:
        if spec.device_type == "cuda":
            device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=collective_timeout())
        layout = ParallelLayout(args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size)
        init_parallel_state(layout, rank, args.enable_expert_parallel, args.all2all_backend,
                            args.expert_placement_strategy)
        worker = Worker(spec, device)
        conn.send_bytes(pickle.dumps(("ok", None)))
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises
        _reply_error(conn, rank)
        return
    try:
        while True:
            try:
                method, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the driver is gone
            if method == "shutdown":
                conn.send_bytes(pickle.dumps(("ok", None)))
                break
            try:
                result = getattr(worker, method)(*payload)
            except BaseException:  # noqa: BLE001
                _reply_error(conn, rank)
                break  # this rank's state may no longer match its peers': stop
            conn.send_bytes(pickle.dumps(("ok", result)))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _reply_error(conn, rank: int) -> None:
    with contextlib.suppress(Exception):
        conn.send_bytes(pickle.dumps(("error", f"rank {rank}: " + traceback.format_exc())))
