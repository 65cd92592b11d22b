"""Executors: where the model runs. The in-process one holds a single ModelRunner; the
multi-process and torchrun executors (one runner per rank) implement the same interface."""
from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod

import torch

from models.config import ModelConfig
from models.loader import init_dummy_weights, load_weights
from moe.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineArgs
from moe.model_runner import ModelRunner, ModelRunnerOutput
from scheduler import SchedulerOutput

logger = logging.getLogger("moe.executor")


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int: ...

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        pass


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
    with torch.device(device), _default_dtype(dtype):
        model = model_cls(config)
    if args.load_format == "dummy":
        init_dummy_weights(model, seed=args.seed)
    else:
        load_weights(model, model_path)
    if args.moe_backend is not None:
        for module in model.modules():
            if hasattr(module, "kernel_backend"):
                module.kernel_backend = args.moe_backend
    return model.eval()


class InProcessExecutor(Executor):
    def __init__(self, model_cls: type, config: ModelConfig, model_path: str, args: EngineArgs,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> None:
        self.args, self.device = args, device
        torch.manual_seed(args.seed)
        self.model = build_model(model_cls, config, model_path, args, device, dtype)
        self.runner = ModelRunner(self.model, device, args.block_size, eos_token_ids, config.vocab_size)

    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        per_block = self.runner.kv_cache_bytes_per_block()
        if self.args.num_gpu_blocks_override is not None:
            return self.args.num_gpu_blocks_override
        if self.device.type == "cpu":
            if self.args.kv_cache_memory_bytes is not None:
                return self.args.kv_cache_memory_bytes // per_block
            # Never more than every sequence at full length could use (plus one block each).
            useful = max_num_seqs * (-(-max_model_len // self.args.block_size) + 1)
            return min(DEFAULT_CPU_KV_CACHE_BYTES // per_block, useful)
        if self.args.kv_cache_memory_bytes is not None:
            return self.args.kv_cache_memory_bytes // per_block
        return self._profile_gpu_blocks(per_block, max_model_len, max_num_batched_tokens)

    def _profile_gpu_blocks(self, per_block: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Run one forward at the token budget, then give the KV cache what is left of
        total x gpu_memory_utilization after the weights, the peak activations and whatever
        else (other processes, the CUDA context) already holds."""
        from moe.profiling import profile_forward

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        profile_forward(self.runner, max_num_batched_tokens, max_model_len)
        peak_extra = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        available = total * self.args.gpu_memory_utilization - (total - free) - peak_extra
        logger.info("Memory profiling: total %.2f GiB, in use %.2f GiB, activation peak %.2f GiB, "
                    "KV cache budget %.2f GiB", total / 2**30, (total - free) / 2**30, peak_extra / 2**30,
                    max(available, 0) / 2**30)
        return max(int(available // per_block), 0)

    def initialize_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)
