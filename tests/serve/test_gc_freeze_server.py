"""An API process freezes its start-up heap out of the garbage collector once its engine client
has started (as the engine core does: tests/moe/test_gc_freeze.py), and hands it back at shutdown."""
from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from moe.config import EngineArgs
from moe.entrypoints.serve.api_server import build_app
from tests.serve.helpers import ENGINE_ARGS


def test_api_process_freezes_its_heap_while_serving(model_dir, monkeypatch):
    monkeypatch.delenv("MOE_GC_FREEZE", raising=False)
    gc.unfreeze()
    app = build_app(EngineArgs(model=model_dir, **ENGINE_ARGS))
    assert gc.get_freeze_count() == 0
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 0
        assert id(app) not in {id(o) for o in gc.get_objects()}
        out = client.post("/v1/completions", json={"model": model_dir, "prompt": "a b", "max_tokens": 3,
                                                   "temperature": 0.0})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    assert gc.get_freeze_count() == 0
