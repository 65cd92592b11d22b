"""moe-runtime: an inference runtime for Mixture-of-Experts language models.

The public names load on first use (PEP 562), so that the model code's building blocks in this
package (moe.distributed, moe.pipeline, moe.moe_block) import without the engine.
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_LAZY = {
    "LLM": "moe.llm",
    "SamplingParams": "moe.sampling_params",
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
