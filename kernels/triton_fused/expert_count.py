"""The Triton launches of kernels/expert_count.py (see there for what they count and why).

Imported only when a kernel runs: a module that decorates Triton kernels must not be imported
before the tests set TRITON_INTERPRET (tests/kernels/conftest.py).

Legend: T rows, K top-k, R replica columns of log_to_phys; BLOCK flat (row, k) slots per program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_enter, pdl_launch

BLOCK = 1024


@triton.jit(do_not_specialize=["N", "row_offset"])
def _count_kernel(ids_ptr, counts_ptr, num_valid_ptr, N, row_offset, K: tl.constexpr, RPT: tl.constexpr,
                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    num_valid = tl.load(num_valid_ptr)
    valid = (offs < N) & ((offs // K + row_offset) // RPT < num_valid)
    ids = tl.load(ids_ptr + offs, mask=valid, other=0).to(tl.int64)
    tl.atomic_add(counts_ptr + ids, tl.full([BLOCK], 1, tl.int64), mask=valid, sem="relaxed")


@triton.jit(do_not_specialize=["N", "row_offset"])
def _map_count_kernel(ids_ptr, phys_ptr, log_to_phys_ptr, replicas_ptr, log_counts_ptr, phys_counts_ptr,
                      num_valid_ptr, N, row_offset, R: tl.constexpr, K: tl.constexpr, RPT: tl.constexpr,
                      BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < N
    ids = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int64)
    replicas = tl.load(replicas_ptr + ids, mask=in_range, other=1)
    row = offs.to(tl.int64) // K + row_offset  # the row in the step's batch: the same on every TP rank
    phys = tl.load(log_to_phys_ptr + ids * R + row % replicas, mask=in_range, other=0)
    tl.store(phys_ptr + offs, phys.to(phys_ptr.dtype.element_ty), mask=in_range)
    valid = in_range & ((offs // K + row_offset) // RPT < tl.load(num_valid_ptr))
    one = tl.full([BLOCK], 1, tl.int64)
    tl.atomic_add(log_counts_ptr + ids, one, mask=valid, sem="relaxed")
    tl.atomic_add(phys_counts_ptr + phys, one, mask=valid, sem="relaxed")



@triton.jit(do_not_specialize=["N", "stride_l"])
def _count_layers_kernel(ids_ptr, counts_ptr, num_valid_ptr, N, stride_l, E, K: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    layer = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = (offs < N) & (offs // K < tl.load(num_valid_ptr))
    ids = tl.load(ids_ptr + layer * stride_l + offs, mask=valid, other=0).to(tl.int64)
    tl.atomic_add(counts_ptr + layer * E + ids, tl.full([BLOCK], 1, tl.int64), mask=valid, sem="relaxed")


def count_layers_triton(ids_LTK: torch.Tensor, counts_LE: torch.Tensor, num_valid: torch.Tensor) -> None:
    L, T, K = ids_LTK.shape
    _count_layers_kernel[(triton.cdiv(T * K, BLOCK), L)](ids_LTK, counts_LE, num_valid, T * K, ids_LTK.stride(0),
                                                         counts_LE.shape[1], K=K, BLOCK=BLOCK, **pdl_launch(ids_LTK))


def count_experts_triton(ids_TK: torch.Tensor, counts_E: torch.Tensor, num_valid: torch.Tensor, row_offset: int,
                         rows_per_token: int) -> None:
    T, K = ids_TK.shape
    _count_kernel[(triton.cdiv(T * K, BLOCK),)](ids_TK, counts_E, num_valid, T * K, row_offset, K=K,
                                                RPT=rows_per_token, BLOCK=BLOCK, **pdl_launch(ids_TK))


def map_to_physical_and_count_triton(ids_TK: torch.Tensor, phys_TK: torch.Tensor, log_to_phys_ER: torch.Tensor,
                                     replica_count_E: torch.Tensor, log_counts_E: torch.Tensor,
                                     phys_counts_P: torch.Tensor, num_valid: torch.Tensor, row_offset: int,
                                     rows_per_token: int) -> None:
    T, K = ids_TK.shape
    _map_count_kernel[(triton.cdiv(T * K, BLOCK),)](
        ids_TK, phys_TK, log_to_phys_ER, replica_count_E, log_counts_E, phys_counts_P, num_valid, T * K, row_offset,
        R=log_to_phys_ER.shape[1], K=K, RPT=rows_per_token, BLOCK=BLOCK, **pdl_launch(ids_TK))
