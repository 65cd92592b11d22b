"""Where the Triton kernel tests run: on a GPU, or on the CPU through the interpreter (which
tests/kernels/conftest.py turns on when there is no GPU)."""
from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton_device = pytest.mark.skipif(not (CUDA or INTERPRET), reason="no GPU and TRITON_INTERPRET is not set")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
