"""Expert-load counting inside the forward: how many routed (token, expert) pairs each expert got.

Legend: T tokens (rows of this call), K top-k, E experts counted (logical or physical), R the
most replicas of one logical expert (EPLB).

Both functions take the step's number of real rows as a device tensor `num_valid` [1] int64,
so a CUDA graph captured at a padded size counts only the rows a replay really carries: row t
counts when (row_offset + t) // rows_per_token < num_valid (row_offset: where these T rows start
in the step's batch, for a tensor-parallel rank that took a slice of it; rows_per_token > 1 when
each row is one (token, expert) pair, as Llama-4's scaled-input path makes them). Nothing is
read back to the host.

On CUDA one Triton launch (kernels/triton_fused/expert_count.py: atomic adds into the resident
int64 counters); elsewhere the torch reference, which is also the oracle of the tests.
"""
from __future__ import annotations

import torch


def _valid_pairs(T: int, K: int, num_valid: torch.Tensor, row_offset: int, rows_per_token: int,
                 device) -> torch.Tensor:
    rows = torch.arange(T, device=device) + row_offset
    return (rows // rows_per_token < num_valid.to(device)).repeat_interleave(K).long()


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def count_experts(ids_TK: torch.Tensor, counts_E: torch.Tensor, num_valid: torch.Tensor,
                  row_offset: int = 0, rows_per_token: int = 1) -> None:
    """counts_E[e] += the number of valid (row, k) slots of ids_TK choosing expert e.

    ids_TK: [T, K] int32/int64 in [0, E); counts_E: [E] int64 (updated in place);
    num_valid: [1] int64 on the same device.
    """
    T, K = ids_TK.shape
    if T == 0:
        return
    if _use_triton(ids_TK):
        from kernels.triton_fused.expert_count import count_experts_triton

        count_experts_triton(ids_TK.contiguous(), counts_E, num_valid, row_offset, rows_per_token)
        return
    valid = _valid_pairs(T, K, num_valid, row_offset, rows_per_token, ids_TK.device)
    counts_E.index_add_(0, ids_TK.reshape(-1).long(), valid)


def count_layers(ids_LTK: torch.Tensor, counts_LE: torch.Tensor, num_valid: torch.Tensor) -> None:
    """counts_LE[l, e] += the valid slots of layer l's ids choosing e: every layer of a step in one
    launch (ids_LTK: [L, T, K] int32/int64, rows contiguous per layer; rows t < num_valid count)."""
    L, T, K = ids_LTK.shape
    if T == 0 or L == 0:
        return
    if _use_triton(ids_LTK):
        from kernels.triton_fused.expert_count import count_layers_triton

        count_layers_triton(ids_LTK, counts_LE, num_valid)
        return
    valid = _valid_pairs(T, K, num_valid, 0, 1, ids_LTK.device).expand(L, T * K)
    counts_LE.scatter_add_(1, ids_LTK.reshape(L, T * K).long(), valid)


def map_to_physical_and_count(ids_TK: torch.Tensor, log_to_phys_ER: torch.Tensor, replica_count_E: torch.Tensor,
                              log_counts_E: torch.Tensor, phys_counts_P: torch.Tensor, num_valid: torch.Tensor,
                              row_offset: int = 0, rows_per_token: int = 1) -> torch.Tensor:
    """The physical expert of each routed slot (EPLB replicas), counting both kinds of load.

    Row t's slot of logical expert e takes replica (row_offset + t) % replica_count_E[e] of
    log_to_phys_ER[e]: deterministic, and consecutive rows choosing a hot expert spread over its
    replicas (a row chooses an expert at most once, so the row alone decides; (t * K + k) would
    send every row's k-th choice to the same replica when K and the count share a factor).
    Returns [T, K] physical ids in the dtype of ids_TK.

    log_to_phys_ER: [E, R] int64 physical ids (columns past an expert's count unused);
    replica_count_E: [E] int64 >= 1; log_counts_E [E] / phys_counts_P [P] int64 (in place).
    """
    T, K = ids_TK.shape
    phys_TK = torch.empty_like(ids_TK)
    if T == 0:
        return phys_TK
    if _use_triton(ids_TK):
        from kernels.triton_fused.expert_count import map_to_physical_and_count_triton

        map_to_physical_and_count_triton(ids_TK.contiguous(), phys_TK, log_to_phys_ER.contiguous(), replica_count_E,
                                         log_counts_E, phys_counts_P, num_valid, row_offset, rows_per_token)
        return phys_TK
    ids = ids_TK.reshape(-1).long()
    row = torch.arange(T * K, device=ids.device) // K + row_offset
    phys = log_to_phys_ER[ids, row % replica_count_E[ids]]
    valid = _valid_pairs(T, K, num_valid, row_offset, rows_per_token, ids.device)
    log_counts_E.index_add_(0, ids, valid)
    phys_counts_P.index_add_(0, phys, valid)
    phys_TK.copy_(phys.view(T, K))
    return phys_TK
