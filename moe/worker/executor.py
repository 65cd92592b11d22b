"""Executors: where the model runs.

* `InProcessExecutor`: one rank, in this process (tensor/pipeline/data parallel sizes all 1).
* `MultiprocExecutor` (moe/worker/parallel_executor.py): `LLM(...)` spawns one worker process per
  rank on this node and drives them over pipes.
* `TorchrunExecutor` (moe/worker/parallel_executor.py): `torchrun` started the ranks; every rank runs
  the whole engine and this process is one rank.

All take a list of SchedulerOutputs per step, one per data-parallel replica
(`execute_models`), and return one ModelRunnerOutput per replica.
"""
from __future__ import annotations

import gc
import logging
from abc import ABC, abstractmethod

import torch

from models.config import ModelConfig
from moe.config import EngineArgs
from moe.worker.model_runner import ModelRunnerOutput
from moe.worker.worker import Worker, WorkerSpec, build_model  # noqa: F401  (build_model: public helper)
from scheduler import KVCacheGroup, SchedulerOutput

logger = logging.getLogger("moe.worker.executor")


class Executor(ABC):
    @abstractmethod
    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int: ...

    @abstractmethod
    def initialize_cache(self, groups: list[KVCacheGroup]) -> None: ...

    @abstractmethod
    def execute_models(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        """One step: scheduler_outputs[d] is DP replica d's batch; returns its sampled tokens."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_models([scheduler_output])[0]

    # Async scheduling (EngineCore._step_async): queue a step, then wait for it after the next
    # one is queued. Executors without it leave `supports_async_steps` False.
    supports_async_steps = False
    supports_deferred_sampling = False

    def launch(self, scheduler_output: SchedulerOutput, prev=None):
        """Queue one step without waiting for it; returns what `collect` takes (None: nothing of
        this step samples). prev: the step still in flight (its handle from launch)."""
        raise NotImplementedError(f"{type(self).__name__} runs synchronous steps only")

    def collect(self, pending) -> ModelRunnerOutput:
        """Wait for a launched step and return its sampled tokens."""
        raise NotImplementedError(f"{type(self).__name__} runs synchronous steps only")

    @abstractmethod
    def expert_load_snapshot(self) -> dict | None:
        """Cumulative expert counts summed over every rank (moe.expert_load.counters.sum_snapshots),
        None when nothing is recorded. Call between steps."""

    @abstractmethod
    def apply_expert_placement(self, phys_to_log_by_layer: dict[int, list[int]]) -> int:
        """EPLB: install a placement on every rank (moves expert weights); slots received in all."""

    @abstractmethod
    def update_weights(self, named_tensors: list) -> int:
        """(Hugging Face name, tensor) pairs loaded into every rank's shards in place; pieces taken in all."""

    @abstractmethod
    def sleep(self, level: int) -> None:
        """Every rank frees its KV cache and graphs (and moves (1) or drops (2) its weights)."""

    @abstractmethod
    def wake_up(self) -> None:
        """Every rank restores what sleep freed."""

    def shutdown(self) -> None:
        pass


class InProcessExecutor(Executor):
    def __init__(self, model_cls: type, config: ModelConfig, model_path: str, args: EngineArgs,
                 device: torch.device, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> None:
        self.args, self.device = args, device
        spec = WorkerSpec(model_cls, config, model_path, args, device.type, dtype, tuple(eos_token_ids))
        self.worker = Worker(spec, device)

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def runner(self):
        return self.worker.runner

    def determine_num_blocks(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.worker.determine_num_blocks(max_num_seqs, max_model_len, max_num_batched_tokens)

    def initialize_cache(self, groups: list[KVCacheGroup]) -> None:
        self.worker.initialize_cache(groups)

    def execute_models(self, scheduler_outputs: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        return [self.worker.runner.execute_model(scheduler_outputs[0])]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.runner.execute_model(scheduler_output)

    supports_async_steps = True

    def launch(self, scheduler_output: SchedulerOutput, prev=None):
        return self.worker.runner.launch(scheduler_output, prev=prev)

    def collect(self, pending) -> ModelRunnerOutput:
        return self.worker.runner.collect(pending)

    # Launch may leave a step's sampling for later (so.deferred_grammar_ids: grammar masks that wait
    # for the step in flight); sample_deferred then samples it with the completed bitmask.
    supports_deferred_sampling = True

    def sample_deferred(self, pending, scheduler_output: SchedulerOutput):
        return self.worker.runner.sample_deferred(pending, scheduler_output)

    def expert_load_snapshot(self) -> dict | None:
        return self.worker.expert_load_snapshot()

    def apply_expert_placement(self, phys_to_log_by_layer: dict[int, list[int]]) -> int:
        return self.worker.apply_expert_placement(phys_to_log_by_layer)

    def update_weights(self, named_tensors: list) -> int:
        return self.worker.update_weights(named_tensors)

    def sleep(self, level: int) -> None:
        self.worker.sleep(level)

    def wake_up(self) -> None:
        self.worker.wake_up()

    def shutdown(self) -> None:
        # Drop the model and the KV cache now, not when the LLM is collected: a second LLM in
        # the same process sizes its KV cache from the GPU memory left free.
        if self.worker is not None:
            self.worker.runner.release()
            self.worker = None
            if self.device.type == "cuda":
                gc.collect()  # modules and graphs in reference cycles hold GPU memory until collected
                torch.cuda.empty_cache()


def make_executor(model_cls: type, config: ModelConfig, model_path: str, args: EngineArgs,
                  device: torch.device, dtype: torch.dtype, eos_token_ids: tuple[int, ...]) -> Executor:
    """The executor the arguments and the environment ask for (see moe.worker.parallel_executor)."""
    from moe.worker.parallel_executor import MultiprocExecutor, TorchrunExecutor, launched_by_torchrun

    backend = args.distributed_executor_backend
    world = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    if backend == "external_launcher" or (backend is None and launched_by_torchrun()):
        return TorchrunExecutor(model_cls, config, model_path, args, device, dtype, eos_token_ids)
    if world == 1 and backend != "mp":
        return InProcessExecutor(model_cls, config, model_path, args, device, dtype, eos_token_ids)
    return MultiprocExecutor(model_cls, config, model_path, args, device, dtype, eos_token_ids)
