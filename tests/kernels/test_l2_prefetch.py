"""L2 prefetch (kernels/l2_prefetch.py): when it is on, that the kernels' prefetch branches compile
for an H100/H200 and sit where their rule puts them (before or after the PDL wait), and on a GPU
that the prefetch changes no result."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels import l2_prefetch  # noqa: E402
from kernels.l2_prefetch import prefetch_enabled  # noqa: E402
from kernels.triton_attention.decode import paged_attention_decode_triton  # noqa: E402
from kernels.triton_fused.skinny_gemm import skinny_linear  # noqa: E402
from kernels.triton_moe.fused import fused_experts_triton  # noqa: E402

from tests.kernels.triton_marks import CUDA  # noqa: E402

HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9
COMPILE_SCRIPT = Path(__file__).with_name("compile_sm90.py")


def test_off_on_the_cpu_and_for_unknown_sites(monkeypatch):
    for site in l2_prefetch.SITES:
        assert not prefetch_enabled(site, torch.zeros(1))
    with pytest.raises(ValueError, match="unknown prefetch site"):
        prefetch_enabled("LM_HEAD", torch.zeros(1))


def test_switches(monkeypatch):
    """On a GPU with bulk copies each site follows its own MOE_PREFETCH_* switch; never under the
    interpreter, never without bulk copies."""
    gpu_tensor = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(l2_prefetch, "_device_has_bulk_copies", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for site in l2_prefetch.SITES:
        monkeypatch.delenv(f"MOE_PREFETCH_{site}", raising=False)
    assert all(prefetch_enabled(site, gpu_tensor) for site in l2_prefetch.SITES)
    monkeypatch.setenv("MOE_PREFETCH_SKINNY", "0")
    assert [prefetch_enabled(site, gpu_tensor) for site in l2_prefetch.SITES] == [True, False, True]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not prefetch_enabled("EXPERTS", gpu_tensor)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(l2_prefetch, "_device_has_bulk_copies", lambda index: False)
    assert not prefetch_enabled("EXPERTS", gpu_tensor)


def test_prefetch_branches_compile_for_sm90_where_their_rule_puts_them():
    """Compiled for sm_90 (no GPU needed): each kernel issues bulk L2 prefetches only with
    PREFETCH on; the down GEMM, the skinny GEMM and decode attention before their PDL wait
    (weights and step inputs), gate_up after it (its expert is known only then)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(COMPILE_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    on, off = report["decode_attention/prefetch_on"], report["decode_attention/prefetch_off"]
    assert on["bulk_prefetches"] == 2 and off["bulk_prefetches"] == 0, (on, off)  # K and V blocks
    assert on["pdl_waits"] == off["pdl_waits"] == 1, (on, off)
    assert on["prefetch_before_wait"], on


def _both_ways(monkeypatch, site, fn):
    outs = []
    for on in ("1", "0"):
        monkeypatch.setenv(f"MOE_PREFETCH_{site}", on)
        outs.append(fn())
        torch.cuda.synchronize()
    return outs


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9 or later")
@pytest.mark.parametrize("T", [1, 3, 16])
def test_experts_same_with_and_without_prefetch(monkeypatch, T):
    g = torch.Generator(device="cuda").manual_seed(T)
    E, D, F, K = 64, 512, 384, 8
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E, 2 * F, D, device="cuda", generator=g) * D ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) * F ** -0.5).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=-1).indices.to(torch.int32)
    wts = torch.rand(T, K, device="cuda", generator=g).softmax(-1)
    on, off = _both_ways(monkeypatch, "EXPERTS", lambda: fused_experts_triton(x, w13, w2, wts, ids))
    assert torch.equal(on, off)


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9 or later")
@pytest.mark.parametrize("M,N,K", [(1, 2048, 4096), (2, 1000, 2048), (1, 128, 2048)])
def test_skinny_same_with_and_without_prefetch(monkeypatch, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16)
    on, off = _both_ways(monkeypatch, "SKINNY", lambda: skinny_linear(x, w))
    assert torch.equal(on, off)


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9 or later")
@pytest.mark.parametrize("chunk", [None, 48])
def test_decode_attention_same_with_and_without_prefetch(monkeypatch, chunk):
    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, G, d, S, blocks = 3, 16, 4, 128, 16, 64
    cache = torch.randn(2, blocks, S, G, d, device="cuda", generator=g).to(torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)[:B * 20].view(B, 20)
    seq_lens = torch.tensor([1, 150, 317], dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, d, device="cuda", generator=g).to(torch.bfloat16)
    on, off = _both_ways(monkeypatch, "ATTN",
                         lambda: paged_attention_decode_triton(q, cache, tables, seq_lens, d ** -0.5, chunk))
    assert torch.equal(on, off)
