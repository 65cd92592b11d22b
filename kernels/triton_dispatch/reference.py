"""Torch references of the fixed-capacity dispatch kernels (kernels/triton_dispatch/pack.py).

Legend: T tokens, K top-k, E experts, P destination ranks, C capacity (rows per destination),
N = P*C send/receive rows, W words of a row's x part, M = 2K+1 metadata int32 per row
(K weight bits, K ids, the row's chunk count), D hidden.

Row n = p*C + s of the send buffer is slot s of destination p. Tokens take the slots of a
destination in token order (a prefix count), so the layout is deterministic; slots past the
destination's count are padding: x zero, weights zero, ids = pad_id_P[p] (an expert not on p).
"""
from __future__ import annotations

import torch


def route_ref(ids_TK: torch.Tensor, owner_E: torch.Tensor, P: int, C: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_PT, tok_N, counts_P): where each (destination, token) pair goes, and back.

    row_PT: [P, T] int64 send row p*C + slot of token t at destination p, or N (= not sent).
    tok_N: [N] int64 token of each send row, -1 for padding.
    counts_P: [P] int64 tokens for each destination (may exceed C: those past C are dropped
        here, and the caller's overflow check reports them).
    """
    T = ids_TK.shape[0]
    dev = ids_TK.device
    N = P * C
    goes_PT = (owner_E.long()[ids_TK.long()][None] == torch.arange(P, device=dev).view(P, 1, 1)).any(dim=2)
    pos_PT = torch.cumsum(goes_PT, dim=1)  # inclusive prefix count: slot + 1
    counts_P = pos_PT[:, -1].clone() if T else torch.zeros(P, dtype=torch.int64, device=dev)
    kept_PT = goes_PT & (pos_PT <= C)
    base_P1 = torch.arange(P, device=dev).view(P, 1) * C
    row_PT = torch.where(kept_PT, base_P1 + pos_PT - 1, torch.full_like(pos_PT, N))
    tok_N1 = torch.full((N + 1,), -1, dtype=torch.int64, device=dev)  # row N: trash of unsent pairs
    tok_N1.index_put_((row_PT.view(-1),), torch.arange(T, device=dev).repeat(P))
    tok_N1[N] = -1
    return row_PT, tok_N1[:N], counts_P


def pack_ref(x_words_TW: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, owner_E: torch.Tensor,
             tok_N: torch.Tensor, counts_P: torch.Tensor, pad_id_P: torch.Tensor, out_words_NW: torch.Tensor,
             out_meta_NM: torch.Tensor, C: int) -> None:
    """Write every send row: the token's x words, its weights (zero for experts not on the row's
    destination), its ids, and the destination's count; padding rows as in the module docstring."""
    N = tok_N.shape[0]
    K = ids_TK.shape[1]
    dev = tok_N.device
    valid_N = tok_N >= 0
    tok = tok_N.clamp(min=0)
    dest_N = torch.arange(N, device=dev) // C
    if x_words_TW.shape[0]:
        out_words_NW.copy_(torch.where(valid_N[:, None], x_words_TW[tok], 0))
        ids_NK = ids_TK.long()[tok]
        here_NK = owner_E.long()[ids_NK] == dest_N[:, None]
        w_NK = torch.where(valid_N[:, None] & here_NK, weights_TK.float()[tok], 0.0)
        ids_NK = torch.where(valid_N[:, None], ids_NK, pad_id_P.long()[dest_N][:, None])
    else:  # no tokens: every row is padding
        out_words_NW.zero_()
        w_NK = torch.zeros(N, K, dtype=torch.float32, device=dev)
        ids_NK = pad_id_P.long()[dest_N][:, None].expand(N, K)
    out_meta_NM[:, :K].copy_(w_NK.view(torch.int32))
    out_meta_NM[:, K:2 * K].copy_(ids_NK)
    out_meta_NM[:, 2 * K].copy_(counts_P[dest_N])


def unpack_ref(meta_NM: torch.Tensor, C: int, weights_out_NK: torch.Tensor, ids_out_NK: torch.Tensor,
               counts_out_P: torch.Tensor) -> None:
    """Dense weights (float32) and ids (the dtype of ids_out_NK) of the received rows, and the
    count each source sent (the count column of the first row of its chunk)."""
    K = ids_out_NK.shape[1]
    weights_out_NK.copy_(meta_NM[:, :K].view(torch.float32))
    ids_out_NK.copy_(meta_NM[:, K:2 * K])
    counts_out_P.copy_(meta_NM[::C, 2 * K])


def combine_ref(back_ND: torch.Tensor, row_PT: torch.Tensor, out_TD: torch.Tensor) -> None:
    """out[t] = sum over p of back[row_PT[p, t]] (rows >= N contribute zero), in fp32, in p order."""
    N, D = back_ND.shape
    P, T = row_PT.shape
    padded_ND = torch.cat([back_ND, back_ND.new_zeros(1, D)])
    rows_PTD = padded_ND.index_select(0, row_PT.clamp(max=N).reshape(-1)).view(P, T, D).float()
    acc_TD = rows_PTD[0].clone()
    for p in range(1, P):  # sequential, as the kernel accumulates
        acc_TD += rows_PTD[p]
    out_TD.copy_(acc_TD)


# ---- the variable-size dispatch (all2all.all_to_all): route with C = T, then compact rows -----

def pack_var_ref(x_words_TW: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, owner_E: torch.Tensor,
                 tok_N: torch.Tensor, counts_P: torch.Tensor, row_PT: torch.Tensor, out_words_SW: torch.Tensor,
                 out_meta_SM: torch.Tensor) -> None:
    """The S = sum(counts_P) rows sent, back to back by destination (a token's rows in token order
    within its destination), from route_ref(..., C=T)'s tok_N / counts_P. Each row: the token's x
    words, its weights (zero for experts not on the destination), its ids (M = 2K int32 here, no
    count column). row_PT (route's capacity rows, P*T = not sent) is rewritten in place to each
    pair's compact row; unsent pairs keep P*T (>= S)."""
    P, T = row_PT.shape
    K = ids_TK.shape[1]
    dev = tok_N.device
    if T == 0:
        return
    offsets_P = torch.cumsum(counts_P, 0) - counts_P
    n_N = torch.arange(P * T, device=dev)
    dest_N, pos_N = n_N // T, n_N % T
    sent_N = tok_N >= 0
    tok_S, dest_S = tok_N[sent_N], dest_N[sent_N]
    row_S = offsets_P[dest_S] + pos_N[sent_N]
    out_words_SW[row_S] = x_words_TW[tok_S]
    ids_SK = ids_TK.long()[tok_S]
    here_SK = owner_E.long()[ids_SK] == dest_S[:, None]
    out_meta_SM[row_S, :K] = torch.where(here_SK, weights_TK.float()[tok_S], 0.0).view(torch.int32)
    out_meta_SM[row_S, K:2 * K] = ids_SK.to(torch.int32)
    row_PT[dest_S, tok_S] = row_S


def unpack_var_ref(meta_RM: torch.Tensor, weights_out_RK: torch.Tensor, ids_out_RK: torch.Tensor) -> None:
    """Dense weights (float32) and ids (the dtype of ids_out_RK) of the received rows."""
    K = ids_out_RK.shape[1]
    weights_out_RK.copy_(meta_RM[:, :K].view(torch.float32))
    ids_out_RK.copy_(meta_RM[:, K:2 * K])
