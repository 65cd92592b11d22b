"""The dispatch steps of the fixed-capacity (low_latency) and variable-size (all_to_all)
dispatchers: a Triton launch on CUDA, the torch reference elsewhere.

Legend and row semantics: reference.py. Every function is device-only (no host sync, no
host->device copy), so a caller can capture it in a CUDA graph.
"""
from __future__ import annotations

import torch

from kernels.triton_dispatch import reference as ref
from kernels.triton_fused import triton_available


def _use_triton(t: torch.Tensor) -> bool:
    """Tests monkeypatch this to run the kernels under TRITON_INTERPRET on CPU tensors."""
    return bool(t.is_cuda) and triton_available()


def route(ids_TK: torch.Tensor, owner_E: torch.Tensor, P: int, C: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_PT [P, T] int64, tok_N [P*C] int64, counts_P [P] int64); see reference.route_ref.

    ids_TK: [T, K] int32/int64 global expert ids; owner_E: [E] int64 owner rank of each expert.
    """
    if _use_triton(ids_TK):
        from kernels.triton_dispatch.pack import route_triton

        return route_triton(ids_TK.contiguous(), owner_E.long().contiguous(), P, C)
    return ref.route_ref(ids_TK, owner_E, P, C)


def pack(x_words_TW: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, owner_E: torch.Tensor,
         tok_N: torch.Tensor, counts_P: torch.Tensor, pad_id_P: torch.Tensor, out_words_NW: torch.Tensor,
         out_meta_NM: torch.Tensor, C: int) -> None:
    """Fill every row of the send buffer (views out_words_NW [N, W], out_meta_NM [N, 2K+1] int32,
    row-strided, inner stride 1); see reference.pack_ref."""
    K = ids_TK.shape[1]
    if out_meta_NM.shape[1] != 2 * K + 1 or out_words_NW.shape[0] != out_meta_NM.shape[0]:
        raise ValueError(f"send views {tuple(out_words_NW.shape)} / {tuple(out_meta_NM.shape)} do not fit K={K}")
    if x_words_TW.shape[0] and x_words_TW.shape[1] != out_words_NW.shape[1]:
        raise ValueError(f"x has {x_words_TW.shape[1]} words per row, the send rows {out_words_NW.shape[1]}")
    if _use_triton(out_words_NW):
        from kernels.triton_dispatch.pack import pack_triton

        pack_triton(x_words_TW.contiguous(), weights_TK.float().contiguous(), ids_TK.contiguous(),
                    owner_E.long().contiguous(), tok_N, counts_P, pad_id_P.long().contiguous(), out_words_NW,
                    out_meta_NM, C)
        return
    ref.pack_ref(x_words_TW, weights_TK, ids_TK, owner_E, tok_N, counts_P, pad_id_P, out_words_NW, out_meta_NM, C)


def unpack(meta_NM: torch.Tensor, C: int, weights_out_NK: torch.Tensor, ids_out_NK: torch.Tensor,
           counts_out_P: torch.Tensor) -> None:
    """Dense float32 weights / ids (dtype of ids_out_NK) and per-source counts of received rows."""
    if _use_triton(meta_NM):
        from kernels.triton_dispatch.pack import unpack_triton

        unpack_triton(meta_NM, C, weights_out_NK, ids_out_NK, counts_out_P)
        return
    ref.unpack_ref(meta_NM, C, weights_out_NK, ids_out_NK, counts_out_P)


def combine(back_ND: torch.Tensor, row_PT: torch.Tensor, out_TD: torch.Tensor) -> None:
    """out_TD[t] = sum_p back_ND[row_PT[p, t]] (rows >= N are zero), fp32 accumulation in p order."""
    if row_PT.shape[1] == 0:
        return
    if _use_triton(back_ND):
        from kernels.triton_dispatch.pack import combine_triton

        combine_triton(back_ND.contiguous(), row_PT.contiguous(), out_TD)
        return
    ref.combine_ref(back_ND, row_PT, out_TD)


def pack_var(x_words_TW: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, owner_E: torch.Tensor,
             tok_N: torch.Tensor, counts_P: torch.Tensor, row_PT: torch.Tensor, out_words_SW: torch.Tensor,
             out_meta_SM: torch.Tensor) -> None:
    """The variable-size send rows, back to back by destination, from route(ids, owner, P, C=T);
    rewrites row_PT to each pair's compact row (see reference.pack_var_ref). out_words_SW [N, W] /
    out_meta_SM [N, 2K] int32: row-strided views of a buffer of N >= sum(counts_P) rows."""
    K = ids_TK.shape[1]
    if out_meta_SM.shape[1] != 2 * K or out_words_SW.shape[0] != out_meta_SM.shape[0]:
        raise ValueError(f"send views {tuple(out_words_SW.shape)} / {tuple(out_meta_SM.shape)} do not fit K={K}")
    if _use_triton(out_words_SW):
        from kernels.triton_dispatch.pack import pack_var_triton

        pack_var_triton(x_words_TW.contiguous(), weights_TK.float().contiguous(), ids_TK.contiguous(),
                        owner_E.long().contiguous(), tok_N, counts_P, row_PT, out_words_SW, out_meta_SM)
        return
    ref.pack_var_ref(x_words_TW, weights_TK, ids_TK, owner_E, tok_N, counts_P, row_PT, out_words_SW, out_meta_SM)


def unpack_var(meta_RM: torch.Tensor, weights_out_RK: torch.Tensor, ids_out_RK: torch.Tensor) -> None:
    """Dense float32 weights and ids (dtype of ids_out_RK) of received variable-size rows."""
    if _use_triton(meta_RM):
        from kernels.triton_dispatch.pack import unpack_var_triton

        unpack_var_triton(meta_RM, weights_out_RK, ids_out_RK)
        return
    ref.unpack_var_ref(meta_RM, weights_out_RK, ids_out_RK)
