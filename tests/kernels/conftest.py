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
