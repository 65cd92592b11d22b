"""The packages form a DAG, read from the source (AST), not by importing: kernels and scheduler
at the bottom, then routing, all2all, models, and moe on top. A package imports only packages of
a lower level, at any depth: function-local imports and importlib.import_module / __import__
with a constant name count too. So models/ never imports moe/, and moe/ keeps its top level small."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVEL = {"kernels": 0, "scheduler": 0, "routing": 1, "all2all": 2, "models": 3, "moe": 4}
MAX_TOP_LEVEL_MOE_FILES = 16  # moe/*.py, __init__.py included: the rest lives in subpackages
_IMPORT_FUNCS = {"import_module", "__import__"}


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`: import statements anywhere in
    the file, and import_module("x") / __import__("x") calls with a constant name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _IMPORT_FUNCS:
                found.append((node.lineno, node.args[0].value))
    return found


def layering_violations(package: str, files: dict[str, str]) -> list[str]:
    """'path:line imports module' for each import of a package at the same or a higher level."""
    out = []
    for path, source in sorted(files.items()):
        for line, module in imported_modules(source):
            top = module.split(".")[0]
            if top in LEVEL and top != package and LEVEL[top] >= LEVEL[package]:
                out.append(f"{path}:{line} imports {module}")
    return out


def _package_files(package: str) -> dict[str, str]:
    files = {}
    for folder, _, names in os.walk(os.path.join(ROOT, package)):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    files[os.path.relpath(path, ROOT)] = f.read()
    return files


def test_packages_import_only_lower_levels():
    found = {package: _package_files(package) for package in LEVEL}
    assert "models/layers/moe.py" in found["models"] and "moe/worker/model_runner.py" in found["moe"]
    violations = [v for package, files in found.items() for v in layering_violations(package, files)]
    assert violations == []


def test_models_need_nothing_of_the_engine():
    """The model code's building blocks live under models/ (parallel state, pipeline helpers, the MoE block)."""
    for module in ["models.parallel.state", "models.parallel.pipeline", "models.layers.moe"]:
        assert os.path.isfile(os.path.join(ROOT, *module.split(".")) + ".py"), module


def test_the_checker_sees_every_kind_of_import():
    source = (
        "import kernels\n"
        "from moe.engine.core import EngineCore\n"
        "def f():\n"
        "    import moe.worker.worker as w\n"
        "    import importlib\n"
        "    return importlib.import_module('moe.config'), __import__('moe')\n"
        "from . import sibling\n"  # relative: stays inside the package
    )
    assert layering_violations("models", {"models/x.py": source}) == [
        "models/x.py:2 imports moe.engine.core", "models/x.py:4 imports moe.worker.worker",
        "models/x.py:6 imports moe.config", "models/x.py:6 imports moe"]
    assert layering_violations("moe", {"moe/x.py": source}) == []
    assert layering_violations("kernels", {"kernels/x.py": "from routing import RouterOutput\n"}) == [
        "kernels/x.py:1 imports routing"]


def test_moe_top_level_stays_small():
    top = [f for f in os.listdir(os.path.join(ROOT, "moe")) if f.endswith(".py")]
    assert "__init__.py" in top and len(top) <= MAX_TOP_LEVEL_MOE_FILES, sorted(top)
