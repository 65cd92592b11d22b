"""Run the Triton kernels on the CPU through the interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, hence here.
"""
import os

try:
    import torch
    _cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty that fills new tensors with NaN (floats) or -7 (ints): an element a kernel never
    writes shows in the result."""
    import torch as _torch
    real_empty = _torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(_torch, "empty", empty)
