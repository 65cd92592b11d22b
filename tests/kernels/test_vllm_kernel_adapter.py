"""`moe bench kernel`'s vLLM contender: the fetch script cuts the right functions out of vLLM's
source, and (where benchmarks/fetch_vllm_kernel.py has been run) our call of vLLM's kernel
matches the torch reference. fp16 on the CPU: the interpreter mis-handles bf16 dots."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from kernels.reference import fused_experts_torch
from moe.bench.vllm_kernel import load_vllm_experts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fetch_script():
    spec = importlib.util.spec_from_file_location("fetch_vllm_kernel",
                                                  os.path.join(ROOT, "benchmarks", "fetch_vllm_kernel.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extract_functions_keeps_decorators_and_order():
    source = ("import x\n\n@triton.jit\ndef fused_moe_kernel(a,\n    b):\n    return a\n\n\n"
              "def other():\n    pass\n\n@triton.jit\ndef write_zeros_to_output(c):\n    pass\n")
    out = _fetch_script().extract_functions(source)
    assert out.index("def write_zeros_to_output") < out.index("def fused_moe_kernel")
    assert out.count("@triton.jit") == 2 and "other" not in out and "    b):\n    return a" in out
    with pytest.raises(SystemExit, match="fused_moe_kernel"):
        _fetch_script().extract_functions("@triton.jit\ndef write_zeros_to_output(c):\n    pass\n")


@pytest.mark.skipif(load_vllm_experts() is None, reason="vLLM's kernel not fetched (benchmarks/fetch_vllm_kernel.py)")
@pytest.mark.parametrize("M", [1, 7])
def test_vllm_kernel_call_matches_the_reference(M):
    vllm = load_vllm_experts()
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float16)
    g = torch.Generator().manual_seed(M)
    D, F, E, K = 64, 32, 4, 2
    x = torch.randn(M, D, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * D ** -0.5).to(device, dtype)
    w2 = (torch.randn(E, D, F, generator=g) * F ** -0.5).to(device, dtype)
    weights, ids = torch.softmax(torch.randn(M, E, generator=g), -1).topk(K, dim=-1)
    weights, ids = weights.to(device), ids.to(device, torch.int32)
    out = vllm(x, w13, w2, weights, ids)
    ref = fused_experts_torch(x, w13, w2, weights, ids)
    assert out.shape == ref.shape
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, err
