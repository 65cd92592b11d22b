"""The ctypes glue of DeepSpeed-FastGen's blocked flash attention (kernels/deepspeed_flash.py): the
parameter structure's layout, the atoms, the compiled block sizes and the input checks on the CPU;
the kernel itself against an fp32 reference on a GPU with the library (skipped elsewhere)."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch

from kernels import deepspeed_flash as dsf


def test_params_layout_matches_the_c_header():
    """Flash_fwd_params as the library was compiled (x86-64 SysV): a reordered or resized field
    would make the kernel read garbage, so every offset is pinned."""
    q = dsf.QkvParams
    assert ctypes.sizeof(q) == 64
    assert [getattr(q, f).offset for f in ("q_ptr", "k_ptr", "v_ptr", "q_row_stride", "v_head_stride", "h",
                                           "h_h_k_ratio")] == [0, 8, 16, 24, 44, 48, 56]
    p = dsf.FlashFwdParams
    offsets = {f: getattr(p, f).offset for f, _ in p._fields_}
    assert offsets == {"qkv": 0, "o_ptr": 64, "atoms": 72, "num_atoms": 80, "o_row_stride": 84,
                       "o_head_stride": 88, "d": 92, "d_rounded": 96, "scale_softmax": 100,
                       "scale_softmax_log2": 104, "is_bf16": 108, "is_causal": 109}
    assert ctypes.sizeof(p) == 112


def test_atoms_split_queries_and_point_at_table_rows():
    tables = torch.arange(3 * 8, dtype=torch.int32).view(3, 8).contiguous()
    # seq 0: 300 new tokens on 100 cached; seq 1: one decode token at position 69; seq 2: 5 fresh tokens
    qsl, lens = [0, 300, 301, 306], [400, 70, 5]
    atoms = dsf.build_atoms(tables, qsl, lens, q_block=128, kv_block=64)
    assert atoms.dtype == torch.int32 and atoms.shape == (5, dsf.ATOM_INT32S)
    base = tables.data_ptr()
    ptrs = [(int(a[0]) & 0xFFFFFFFF) | ((int(a[1]) & 0xFFFFFFFF) << 32) for a in atoms]
    assert ptrs == [base] * 3 + [base + 8 * 4, base + 2 * 8 * 4]
    # (first query row, queries, KV blocks, KV tokens seen by the last query, first position, unused)
    assert atoms[:, 2:].tolist() == [[0, 128, 4, 228, 100, 0], [128, 128, 6, 356, 228, 0],
                                     [256, 44, 7, 400, 356, 0], [300, 1, 2, 70, 69, 0], [301, 5, 1, 5, 0, 0]]


def test_atoms_reject_bad_inputs():
    tables = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        dsf.build_atoms(tables.long(), [0, 1, 2], [1, 1], 128, 64)
    with pytest.raises(ValueError, match="entries"):
        dsf.build_atoms(tables, [0, 1], [1, 1], 128, 64)
    with pytest.raises(ValueError, match="blocks of 64"):
        dsf.build_atoms(tables, [0, 1, 2], [1, 200], 128, 64)  # 200 tokens need 4 blocks, the table has 2


@pytest.mark.parametrize("d,cc,q_block,kv_block", [
    (64, (9, 0), 128, 128), (128, (9, 0), 128, 64), (128, (8, 6), 64, 64), (160, (8, 0), 128, 32),
    (160, (8, 9), 64, 64), (192, (9, 0), 128, 64), (256, (8, 0), 128, 64), (256, (9, 0), 64, 64)])
def test_compiled_block_sizes(d, cc, q_block, kv_block):
    assert dsf.q_block_size(d, cc) == q_block and dsf.kv_block_size(d, cc) == kv_block


def test_cpu_tensors_refused():
    q = torch.zeros(2, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        dsf.blocked_flash_attention(q, torch.zeros(2, 1, 64, 1, 128, dtype=torch.bfloat16),
                                    torch.zeros(1, 8, dtype=torch.int32), 0.1)


def _library_ready() -> bool:
    return (torch.cuda.is_available() and (8, 0) <= torch.cuda.get_device_capability() <= (9, 0)
            and dsf.library_path() is not None)


@pytest.mark.skipif(not _library_ready(), reason="needs a cc 8.x/9.0 GPU and libblockedflash.so")
def test_matches_reference_on_gpu():
    cc = torch.cuda.get_device_capability()
    H, G, d = 8, 2, 128
    S, QB = dsf.kv_block_size(d, cc), dsf.q_block_size(d, cc)
    g = torch.Generator(device="cuda").manual_seed(0)
    new, cached = [200, 1, 37], [0, 150, 64]
    lens = [n + c for n, c in zip(new, cached)]
    nblk = max(math.ceil(L / S) for L in lens)
    N = len(new) * nblk
    cache = torch.randn(2, N, S, G, d, device="cuda", dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(N, device="cuda", generator=g).to(torch.int32).view(len(new), nblk).contiguous()
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], H, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out = dsf.blocked_flash_attention(q, cache, dsf.build_atoms(tables, qsl, lens, QB, S), d ** -0.5)
    torch.cuda.synchronize()
    for b, (n, c) in enumerate(zip(new, cached)):
        kv = cache[:, tables[b].long()].reshape(2, -1, G, d)[:, :n + c].float().repeat_interleave(H // G, dim=2)
        s = torch.einsum("qhd,khd->hqk", q[qsl[b]:qsl[b + 1]].float(), kv[0]) * d ** -0.5
        s = s.masked_fill(torch.arange(n + c, device="cuda")[None, :] > torch.arange(c, c + n, device="cuda")[:, None],
                          float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), kv[1])
        got = out[qsl[b]:qsl[b + 1]].float()
        assert (got - ref).norm() / ref.norm() < 2e-2, b


@pytest.mark.skipif(dsf.library_path() is None, reason="libblockedflash.so not installed (deepspeed-kernels)")
def test_library_exports_run_mha_fwd():
    """The symbol this module calls exists in the installed library (no GPU needed to load it)."""
    assert dsf._run_mha_fwd() is not None
