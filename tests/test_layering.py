"""The model code and its building blocks import nothing of the engine: importing any file under
models/ (or moe.distributed / moe.pipeline / moe.moe_block) in a fresh interpreter loads none of
the engine's modules, nor prometheus_client."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_MODULES = ["moe.llm", "moe.engine", "moe.executor", "moe.parallel_executor", "moe.model_runner",
                  "moe.worker", "moe.metrics", "moe.cli", "moe.bench", "prometheus_client"]
BUILDING_BLOCKS = ["moe.distributed", "moe.pipeline", "moe.moe_block"]

# One interpreter imports the modules one after another and reports, after each, which engine
# modules are loaded: a module that pulls in the engine shows up at its own step (the steps
# before it found none, so nothing was loaded yet).
_PROBE = """
import importlib, json, sys
found = {}
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    found[name] = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
print(json.dumps(found))
"""


def _model_modules() -> list[str]:
    names = []
    for folder, _, files in os.walk(os.path.join(ROOT, "models")):
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3]
                names.append(rel.replace(os.sep, ".").removesuffix(".__init__"))
    return sorted(names)


def test_model_files_load_no_engine_module():
    modules = BUILDING_BLOCKS + _model_modules()
    assert "models.qwen3_moe" in modules and "models.layers.linear" in modules  # the walk found the files
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(modules), json.dumps(ENGINE_MODULES)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert list(found) == modules
    loaded = {name: engine for name, engine in found.items() if engine}
    assert loaded == {}, f"importing these loads engine modules: {loaded}"


def test_probe_detects_an_engine_import():
    """The probe itself can fail: importing moe.llm reports the engine modules."""
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(["moe.distributed", "moe.llm"]),
                          json.dumps(ENGINE_MODULES)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)
    assert found["moe.distributed"] == []
    assert "moe.engine" in found["moe.llm"] and "prometheus_client" in found["moe.llm"]
