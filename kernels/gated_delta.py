"""Gated DeltaNet, the linear-attention layers of Qwen3-Next / Qwen3.5-MoE: the depthwise causal
conv over the mixed q, k, v channels, the gated delta rule and the gated RMS norm of its output.
This file is the pure-torch reference (the CPU path, and what GPU kernels are checked against);
it runs on any device.

The batch is flat (varlen): T tokens of B sequences, sequence b owning rows
query_start_loc[b] .. query_start_loc[b + 1] - 1 (query_start_loc: host list of B + 1 offsets).
Each sequence has a slot slots_B[b] (int64 [B], distinct) in the layer's state pools, which carry
its state from one engine step (prefill chunk or decode step) to the next; has_initial_B[b] (bool
[B]) says whether it continues from that state (True) or starts at position 0 (False: the slot's
contents are ignored, as if zeros). Both kernels write every sequence's new state back to its slot
in place and leave the other slots alone. A negative slot (a CUDA graph's padding sequence) reads
zeros and is written nowhere.

Legend: T tokens, B sequences, N pool slots. Conv: C channels, K kernel width, S = K - 1 state
columns. Delta rule: K key heads (q, k) of dim d, V value heads of dim e, V a multiple of K (value
head h reads key head h // (V // K), as transformers' repeat_interleave).

The delta rule, per sequence and value head with state S [d, e] (fp32), for each token:
S = exp(g_t) S; delta_t = beta_t (v_t - S^T k_t); S = S + k_t delta_t^T; o_t = S^T q_t,
with q, k L2-normalised and q scaled by d ** -0.5 (transformers' torch_recurrent_gated_delta_rule).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _live_slots(slots_B: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots to gather from, negative ones as slot 0; which are real slots)."""
    slots = slots_B.to(dev, torch.int64)
    live = slots >= 0
    return slots.clamp(min=0), live


def _write_back(pool: torch.Tensor, slots: torch.Tensor, live: torch.Tensor, new: torch.Tensor) -> None:
    """pool[slots[b]] = new[b] for the real slots (a padding sequence's state goes nowhere)."""
    if bool(live.all()):
        pool.index_copy_(0, slots, new)
    else:
        pool.index_copy_(0, slots[live], new[live])


def _check_batch(T: int, query_start_loc, slots_B: torch.Tensor, has_initial_B: torch.Tensor) -> list[int]:
    """Validates the varlen layout and the slot arguments; returns the B sequence lengths."""
    if slots_B.dim() != 1 or slots_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots_B must be an int64 [B] tensor, got {slots_B.dtype} {tuple(slots_B.shape)}")
    B = slots_B.shape[0]
    if has_initial_B.shape != (B,) or has_initial_B.dtype != torch.bool:
        raise ValueError(f"has_initial_B must be a bool [B={B}] tensor, got "
                         f"{has_initial_B.dtype} {tuple(has_initial_B.shape)}")
    if len(query_start_loc) != B + 1:
        raise ValueError(f"query_start_loc has {len(query_start_loc)} offsets, expected B + 1 = {B + 1}")
    if query_start_loc[0] != 0 or query_start_loc[-1] != T:
        raise ValueError(f"query_start_loc must run from 0 to T={T}, got "
                         f"{query_start_loc[0]} .. {query_start_loc[-1]}")
    lens = [end - start for start, end in zip(query_start_loc[:-1], query_start_loc[1:])]
    if any(n < 0 for n in lens):
        raise ValueError(f"query_start_loc must be non-decreasing, got {list(query_start_loc)}")
    return lens


def _ranges(starts: list[int], lens: list[int], device: torch.device) -> torch.Tensor:
    """The ranges starts[i] .. starts[i] + lens[i] - 1, concatenated: int64 [sum(lens)]."""
    total = sum(lens)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    first = torch.tensor(starts, dtype=torch.int64, device=device) - (lens_t.cumsum(0) - lens_t)
    return torch.arange(total, device=device) + first.repeat_interleave(lens_t, output_size=total)


def causal_conv1d_varlen(x_TC: torch.Tensor, weight_CK: torch.Tensor, bias_C: torch.Tensor | None,
                         query_start_loc: list[int], conv_state_NCS: torch.Tensor, slots_B: torch.Tensor,
                         has_initial_B: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv of each sequence over time, continuing from its conv state.

    y[t, c] = act(bias[c] + sum_j weight_CK[c, j] * xx[t - S + j, c]), xx being the sequence's
    history (its last S inputs, from conv_state_NCS[slot] oldest first if has_initial, else zeros)
    followed by this step's inputs; activation "silu" or None. Accumulates in fp32, returns [T, C]
    in x's dtype. Writes conv_state_NCS[slots_B[b]] = the last S columns of (history ++ inputs), in
    the state's dtype: a step shorter than S keeps part of the old history.
    """
    if x_TC.dim() != 2:
        raise ValueError(f"x_TC must be [T, C], got {tuple(x_TC.shape)}")
    T, C = x_TC.shape
    if weight_CK.dim() != 2 or weight_CK.shape[0] != C or weight_CK.shape[1] < 1:
        raise ValueError(f"weight_CK must be [C={C}, K], got {tuple(weight_CK.shape)}")
    S = weight_CK.shape[1] - 1
    if bias_C is not None and bias_C.shape != (C,):
        raise ValueError(f"bias_C must be [C={C}] or None, got {tuple(bias_C.shape)}")
    if conv_state_NCS.dim() != 3 or conv_state_NCS.shape[1:] != (C, S):
        raise ValueError(f"conv_state_NCS must be [N, C={C}, S={S}], got {tuple(conv_state_NCS.shape)}")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    lens = _check_batch(T, query_start_loc, slots_B, has_initial_B)
    B, dev = len(lens), x_TC.device
    slots, live = _live_slots(slots_B, dev)
    has_initial_B = has_initial_B.to(dev) & live

    # Every sequence's segment is its S history rows then its tokens, the segments back to back in
    # one fp32 buffer xx [B * S + T, C]; every token's window is then the K rows ending at its own,
    # so all tokens of all sequences (decode and prefill alike) are one gather-multiply per tap.
    seg_start = [query_start_loc[b] + b * S for b in range(B)]
    hist_rows = _ranges(seg_start, [S] * B, dev)
    tok_rows = _ranges([s + S for s in seg_start], lens, dev)
    hist_BSC = conv_state_NCS[slots].transpose(1, 2).float()
    # where, not a multiply: a fresh sequence's slot may hold anything, NaN included
    hist_BSC = torch.where(has_initial_B.to(dev)[:, None, None], hist_BSC, 0.0)
    xx = torch.empty(B * S + T, C, dtype=torch.float32, device=dev)
    xx[hist_rows] = hist_BSC.reshape(B * S, C)
    xx[tok_rows] = x_TC.float()

    w_CK = weight_CK.float()
    y_TC = xx[tok_rows - S] * w_CK[:, 0]
    for j in range(1, S + 1):
        y_TC += xx[tok_rows - S + j] * w_CK[:, j]
    if bias_C is not None:
        y_TC += bias_C.float()
    if activation == "silu":
        y_TC = F.silu(y_TC)

    # The last S rows of each segment (it ends where the next sequence's history starts)
    tail_rows = _ranges([query_start_loc[b + 1] + b * S for b in range(B)], [S] * B, dev)
    new_BCS = xx[tail_rows].view(B, S, C).transpose(1, 2)
    _write_back(conv_state_NCS, slots, live, new_BCS.to(conv_state_NCS.dtype))
    return y_TC.to(x_TC.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (transformers' / FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _recurrent_step(state_nVde, q_nVd, k_nVd, v_nVe, g_nV, beta_nV):
    """One token of n independent sequences: returns (o [n, V, e], new state [n, V, d, e])."""
    state_nVde = state_nVde * g_nV.exp()[..., None, None]
    delta_nVe = beta_nV[..., None] * (v_nVe - torch.einsum("nhde,nhd->nhe", state_nVde, k_nVd))
    state_nVde = state_nVde + k_nVd[..., None] * delta_nVe[..., None, :]
    return torch.einsum("nhde,nhd->nhe", state_nVde, q_nVd), state_nVde


def _chunked(q_TVd, k_TVd, v_TVe, g_TV, beta_TV, starts: list[int], lens: list[int], state_PVde,
             chunk_size: int, o_TVe):
    """The delta rule over P sequences (rows starts[p] .. starts[p] + lens[p] - 1, lens descending)
    from their states state_PVde (advanced in place and returned), chunk by chunk; writes their rows of o_TVe.

    Within a chunk (positions i, j; G = cumsum of g from the chunk's start, Gam_ij = exp(G_i - G_j)
    for j <= i, else 0; S0 the state entering the chunk) the recurrence unrolls to
        delta_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} Gam_ij (k_i . k_j) delta_j),
    i.e. (I + A) Delta = beta V - beta exp(G) K S0 with A = strict_tril(beta K K^T * Gam): one unit
    lower-triangular solve per chunk gives U = (I + A)^-1 beta V and W = (I + A)^-1 beta exp(G) K,
    and then, chunk after chunk, Delta = U - W S0,
        O = exp(G) Q S0 + (Q K^T * Gam) Delta,   S1 = exp(G_last) S0 + (exp(G_last - G) K)^T Delta.
    Every exponent is <= 0 (g <= 0), so nothing overflows however strong the decay.
    """
    dev, Cs = q_TVd.device, chunk_size
    n_chunks = [-(-n // Cs) for n in lens]
    chunk_start = [sum(n_chunks[:p]) for p in range(len(lens))]
    Nc = sum(n_chunks)
    src = _ranges(starts, lens, dev)
    dst = _ranges([c * Cs for c in chunk_start], lens, dev)

    def to_chunks(x_T):
        # Zero padding past a sequence's end: k = beta = 0 write nothing and g = 0 decays nothing,
        # so the final state is exact; the padded rows' outputs are dropped.
        pad = x_T.new_zeros(Nc * Cs, *x_T.shape[1:]).index_copy_(0, dst, x_T[src])
        return pad.view(Nc, Cs, *x_T.shape[1:]).transpose(1, 2)  # [Nc, V, Cs, ...]

    q, k, v, g, beta = (to_chunks(x) for x in (q_TVd, k_TVd, v_TVe, g_TV, beta_TV))
    G = g.cumsum(-1)  # [Nc, V, Cs]
    causal = torch.ones(Cs, Cs, dtype=torch.bool, device=dev).tril()
    # Masked before the exp: above the diagonal G_i - G_j >= 0 and could overflow
    gam = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = beta[..., None] * (k @ k.transpose(-1, -2)) * gam
    # Lower and unitriangular, the solve reads only A's strict lower triangle and takes ones for its
    # diagonal: it solves (I + strict_tril(A)) X = rhs
    UW = torch.linalg.solve_triangular(A, torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], -1),
                                       upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], k.shape[-1]], -1)
    attn = (q @ k.transpose(-1, -2)) * gam
    q_in = q * G.exp()[..., None]  # reads the entering state
    k_out = k * (G[..., -1:] - G).exp()[..., None]  # written into the leaving state
    decay = G[..., -1].exp()[..., None, None]

    # The scan over chunks: step i advances the sequences with more than i chunks (lens descending:
    # the first ones) by their chunk i.
    o = torch.empty_like(U)
    chunk_start_t = torch.tensor(chunk_start, dtype=torch.int64, device=dev)
    for i in range(n_chunks[0]):
        m = sum(n > i for n in n_chunks)
        c = chunk_start_t[:m] + i
        S0 = state_PVde[:m]
        delta = U[c] - W[c] @ S0
        o[c] = q_in[c] @ S0 + attn[c] @ delta
        state_PVde[:m] = S0 * decay[c] + k_out[c].transpose(-1, -2) @ delta
    o_TVe[src] = o.transpose(1, 2).reshape(Nc * Cs, *o_TVe.shape[1:])[dst]
    return state_PVde


def gated_delta_rule_varlen(q_TKd: torch.Tensor, k_TKd: torch.Tensor, v_TVe: torch.Tensor, g_TV: torch.Tensor,
                            beta_TV: torch.Tensor, query_start_loc: list[int], ssm_state_NVde: torch.Tensor,
                            slots_B: torch.Tensor, has_initial_B: torch.Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = True, chunk_size: int = 64) -> torch.Tensor:
    """The gated delta rule of each sequence (module docstring), from its state.

    g_TV: log decay (<= 0) per token and value head; beta_TV: write strength in (0, 1).
    use_qk_l2norm: L2-normalise q and k over d first (in fp32); q is then scaled by `scale`
    (default d ** -0.5). The state is ssm_state_NVde[slot] (fp32 [N, V, d, e]) if has_initial, else
    zeros; the final state is written back there in place. All maths in fp32; returns [T, V, e] in
    q's dtype. One-token sequences (decode) go together through one recurrent step; longer ones
    through the chunked form (chunks of chunk_size tokens, see _chunked), which agrees with it to
    fp32 rounding.
    """
    if q_TKd.dim() != 3 or k_TKd.shape != q_TKd.shape:
        raise ValueError(f"q_TKd and k_TKd must both be [T, K, d], got {tuple(q_TKd.shape)} and {tuple(k_TKd.shape)}")
    T, Hk, Dk = q_TKd.shape
    if v_TVe.dim() != 3 or v_TVe.shape[0] != T:
        raise ValueError(f"v_TVe must be [T={T}, V, e], got {tuple(v_TVe.shape)}")
    Hv, Dv = v_TVe.shape[1:]
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")
    for name, t in (("g_TV", g_TV), ("beta_TV", beta_TV)):
        if t.shape != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, V={Hv}], got {tuple(t.shape)}")
    if ssm_state_NVde.dim() != 4 or ssm_state_NVde.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"ssm_state_NVde must be [N, V={Hv}, d={Dk}, e={Dv}], got {tuple(ssm_state_NVde.shape)}")
    if ssm_state_NVde.dtype != torch.float32:
        raise ValueError(f"ssm_state_NVde must be float32, got {ssm_state_NVde.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    lens = _check_batch(T, query_start_loc, slots_B, has_initial_B)
    dev = q_TKd.device
    slots, live = _live_slots(slots_B, dev)
    has_initial_B = has_initial_B.to(dev) & live

    q, k = q_TKd.float(), k_TKd.float()
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (Dk ** -0.5 if scale is None else scale)
    q, k = (x.repeat_interleave(Hv // Hk, dim=1) for x in (q, k))
    v, g, beta = v_TVe.float(), g_TV.float(), beta_TV.float()

    state_BVde = torch.where(has_initial_B.to(dev)[:, None, None, None], ssm_state_NVde[slots], 0.0)
    o_TVe = torch.empty(T, Hv, Dv, dtype=torch.float32, device=dev)
    decode = [b for b, n in enumerate(lens) if n == 1]
    if decode:
        seq = torch.tensor(decode, dtype=torch.int64, device=dev)
        tok = torch.tensor([query_start_loc[b] for b in decode], dtype=torch.int64, device=dev)
        o_TVe[tok], state_BVde[seq] = _recurrent_step(state_BVde[seq], q[tok], k[tok], v[tok], g[tok], beta[tok])
    prefill = sorted((b for b, n in enumerate(lens) if n > 1), key=lambda b: -lens[b])
    if prefill:
        seq = torch.tensor(prefill, dtype=torch.int64, device=dev)
        state_BVde[seq] = _chunked(q, k, v, g, beta, [query_start_loc[b] for b in prefill], [lens[b] for b in prefill],
                                   state_BVde[seq], chunk_size, o_TVe)
    # Zero-token sequences write back their initial state (zeros when not has_initial)
    _write_back(ssm_state_NVde, slots, live, state_BVde)
    return o_TVe.to(q_TKd.dtype)


def rms_norm_gated(x_TVe: torch.Tensor, z_TVe: torch.Tensor, weight_e: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm of x over its last dim, scaled by weight_e and gated by silu(z) (transformers'
    Qwen3NextRMSNormGated, roundings included: the norm is cast to x's dtype before the weight).
    x and z: any same shape [..., e]; returns x's shape, in x's dtype."""
    if z_TVe.shape != x_TVe.shape:
        raise ValueError(f"z must have x's shape {tuple(x_TVe.shape)}, got {tuple(z_TVe.shape)}")
    if x_TVe.dim() == 0:
        raise ValueError("x must have at least one dim (the normalised one)")
    if weight_e.shape != (x_TVe.shape[-1],):
        raise ValueError(f"weight_e must be [e={x_TVe.shape[-1]}], got {tuple(weight_e.shape)}")
    x = x_TVe.float()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = weight_e * n.to(x_TVe.dtype)
    return (n * F.silu(z_TVe.float())).to(x_TVe.dtype)
