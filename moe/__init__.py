"""moe-runtime: an inference runtime for Mixture-of-Experts language models.

The public names load on first use (PEP 562): `import moe` (and so the `moe` command's `--help`)
stays fast, and a subpackage imports without the whole engine.

Subpackages, by the process that runs them (docs/architecture.md has the picture):
  entrypoints/  the user's process: LLM, the `moe` command, the server's API processes
  engine/       input processing, the engine core (its own process under `moe serve`), output processing
  worker/       executors, the worker and its model runner (one process per rank when there are several)
  expert_load/  expert-load counters (worker), totals and recording windows (engine core), the file
  multimodal/   image inputs and their caches;  dashboard/  the expert-load page;  bench/  `moe bench`
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "moe.entrypoints.llm",
    "SamplingParams": "moe.sampling_params",
    "StructuredOutputsParams": "moe.structured_output.params",
    "RequestOutput": "moe.outputs",
    "CompletionOutput": "moe.outputs",
    "Logprob": "moe.outputs",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moe' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
