"""The start-up heap is frozen out of the garbage collector once an engine is built (no full
collection walks the model mid-serving) and handed back at shutdown."""
from __future__ import annotations

import gc

import pytest

import moe.engine.core as core_module
import moe.worker.worker as worker_module
from moe import LLM, SamplingParams


def _tracked_ids() -> set[int]:
    """Ids of the objects the collector walks (frozen ones are not among them)."""
    return {id(o) for o in gc.get_objects()}


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("frozen_by", ["engine", "worker"])
def test_engine_freezes_its_heap_and_shutdown_releases_it(monkeypatch, frozen_by):
    """Both the engine core and each worker freeze (in the engine's process, in a worker process
    of a parallel layout): with the other one's freeze taken out, each still freezes the heap."""
    monkeypatch.delenv("MOE_GC_FREEZE", raising=False)
    other = worker_module if frozen_by == "engine" else core_module
    monkeypatch.setattr(other, "freeze_startup_heap", lambda: None)
    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu")
    core = llm.llm_engine.core
    assert gc.get_freeze_count() > 0
    tracked = _tracked_ids()
    model = core.executor.worker.runner.model
    for obj in (core, core.scheduler, model, next(model.parameters())):
        assert id(obj) not in tracked

    # Serving still works, and what the requests make is collected as usual.
    out = llm.generate(["a b c"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4

    llm.shutdown()
    assert gc.get_freeze_count() == 0
    assert id(core.scheduler) in _tracked_ids()


def test_freeze_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MOE_GC_FREEZE", "0")
    llm = LLM("tiny-qwen3-moe", dtype="float32", device="cpu")
    assert gc.get_freeze_count() == 0
    assert id(llm.llm_engine.core.scheduler) in _tracked_ids()
    llm.shutdown()
