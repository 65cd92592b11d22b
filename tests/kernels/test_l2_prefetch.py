"""Bulk L2 prefetch (kernels/l2_prefetch.py) in split-KV decode attention: when it is on, that its
branch compiles for an H100/H200 before the PDL wait, and on a GPU that it changes no result."""
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
from kernels.triton_attention import decode  # noqa: E402
from kernels.triton_attention.decode import paged_attention_decode_triton  # noqa: E402

from tests.kernels.triton_marks import CUDA  # noqa: E402

HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9
COMPILE_SCRIPT = Path(__file__).with_name("compile_sm90.py")


def test_supported_only_compiled_on_gpus_with_bulk_copies(monkeypatch):
    gpu_tensor = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    assert not l2_prefetch.bulk_prefetch_supported(torch.zeros(1))
    monkeypatch.setattr(l2_prefetch.pdl, "hopper_or_later", lambda index: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert l2_prefetch.bulk_prefetch_supported(gpu_tensor)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not l2_prefetch.bulk_prefetch_supported(gpu_tensor)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(l2_prefetch.pdl, "hopper_or_later", lambda index: False)
    assert not l2_prefetch.bulk_prefetch_supported(gpu_tensor)


def test_decode_prefetch_compiles_for_sm90_before_the_wait():
    """Compiled for sm_90 (no GPU needed): with PREFETCH the decode kernel asks for the K and V
    blocks (two request sites) before its PDL wait; without, it asks for nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(COMPILE_SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    on, off = report["decode_attention/prefetch_on"], report["decode_attention/prefetch_off"]
    assert on["bulk_prefetches"] == 2 and off["bulk_prefetches"] == 0, (on, off)
    assert on["pdl_waits"] == off["pdl_waits"] == 1, (on, off)
    assert on["prefetch_before_wait"], on


@pytest.mark.skipif(not HOPPER, reason="needs a GPU of compute capability 9 or later")
@pytest.mark.parametrize("chunk", [None, 48])
def test_decode_attention_same_with_and_without_prefetch(monkeypatch, chunk):
    g = torch.Generator(device="cuda").manual_seed(7)
    B, H, G, d, S, blocks = 3, 16, 4, 128, 16, 64
    cache = torch.randn(2, blocks, S, G, d, device="cuda", generator=g).to(torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)[:B * 20].view(B, 20)
    seq_lens = torch.tensor([1, 150, 317], dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, d, device="cuda", generator=g).to(torch.bfloat16)
    outs = []
    for max_seqs in (B, 0):  # prefetched, then not
        monkeypatch.setattr(decode, "PREFETCH_MAX_SEQS", max_seqs)
        outs.append(paged_attention_decode_triton(q, cache, tables, seq_lens, d ** -0.5, chunk))
    assert torch.equal(outs[0], outs[1])
