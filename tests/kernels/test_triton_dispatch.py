"""The dispatch kernels (kernels/triton_dispatch), fixed-capacity and variable-size: the torch
references against a plain Python oracle, the Triton kernels (under TRITON_INTERPRET=1 without a
GPU) against the references, and on a GPU the `low_latency` dispatcher captured in a CUDA graph.

Legend: T tokens, K top-k, E experts, P ranks, C capacity, N = P*C rows, W x words, M = 2K+1.
Kernel outputs start poisoned (-7 / NaN) so an element never written shows.
"""
from __future__ import annotations


import pytest
import torch

import kernels.triton_dispatch.ops as ops
from kernels.triton_dispatch import reference as ref

from tests.kernels.triton_marks import needs_triton_device, needs_cuda, DEV  # noqa: E402

# (T, K, E, P, C): empty, capacity exactly T, T not a power of two, more tokens than BLOCK_T.
SHAPES = [(0, 2, 8, 2, 4), (5, 2, 8, 2, 5), (7, 3, 12, 4, 9), (13, 1, 4, 4, 13), (150, 4, 16, 2, 160)]


def _problem(T, K, E, P, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids_TK = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32 if seed % 2 else torch.int64)
    owner_E = torch.arange(E) // (E // P)
    weights_TK = torch.rand(T, K, generator=g)
    x_TD = torch.randn(T, 6, generator=g)
    pad_P = torch.tensor([int((owner_E != p).nonzero()[0]) for p in range(P)])
    return x_TD, weights_TK, ids_TK, owner_E, pad_P


def _route_oracle(ids_TK, owner_E, P, C):
    T = ids_TK.shape[0]
    row = torch.full((P, T), P * C, dtype=torch.int64)
    tok = torch.full((P * C,), -1, dtype=torch.int64)
    counts = [0] * P
    for t in range(T):
        for p in sorted({int(owner_E[e]) for e in ids_TK[t].tolist()}):
            if counts[p] < C:
                row[p, t] = p * C + counts[p]
                tok[p * C + counts[p]] = t
            counts[p] += 1
    return row, tok, torch.tensor(counts)


def _triton(monkeypatch, on: bool):
    """on: the Triton path (GPU, or the interpreter on CPU tensors); off: the reference."""
    monkeypatch.setattr(ops, "_use_triton", lambda t: on)


@pytest.mark.parametrize("T,K,E,P,C", SHAPES + [(9, 2, 8, 2, 3)])  # the last overflows C
def test_route_reference_matches_oracle(T, K, E, P, C):
    _, _, ids_TK, owner_E, _ = _problem(T, K, E, P, seed=T)
    for got, want in zip(ref.route_ref(ids_TK, owner_E, P, C), _route_oracle(ids_TK, owner_E, P, C)):
        assert torch.equal(got, want), (got, want)


def _pack_all(monkeypatch, on, T, K, E, P, C, seed):
    x_TD, weights_TK, ids_TK, owner_E, pad_P = (t.to(DEV) for t in _problem(T, K, E, P, seed))
    _triton(monkeypatch, on)
    row_PT, tok_N, counts_P = ops.route(ids_TK, owner_E, P, C)
    words_NW = torch.full((P * C, 6), -7.0, device=DEV).view(torch.int32)  # fp32 x as int32 words
    meta_NM = torch.full((P * C, 2 * K + 1), -7, dtype=torch.int32, device=DEV)
    ops.pack(x_TD.view(torch.int32), weights_TK, ids_TK, owner_E, tok_N, counts_P, pad_P, words_NW, meta_NM, C)
    return (row_PT, tok_N, counts_P, words_NW, meta_NM), (x_TD, weights_TK, ids_TK, owner_E, pad_P)


@needs_triton_device
@pytest.mark.parametrize("T,K,E,P,C", SHAPES)
def test_route_and_pack_triton_match_reference(monkeypatch, T, K, E, P, C):
    got, _ = _pack_all(monkeypatch, True, T, K, E, P, C, seed=T + 1)
    want, _ = _pack_all(monkeypatch, False, T, K, E, P, C, seed=T + 1)
    for name, g, w in zip(("row_PT", "tok_N", "counts_P", "words", "meta"), got, want):
        assert torch.equal(g.cpu(), w.cpu()), name


@pytest.mark.parametrize("T,K,E,P,C", SHAPES[1:3])
def test_pack_rows_mean_what_they_say(monkeypatch, T, K, E, P, C):
    outs, ins = _pack_all(monkeypatch, False, T, K, E, P, C, seed=3)
    # checked on the host (on a GPU machine the pack ran on the device)
    (row_PT, tok_N, counts_P, words_NW, meta_NM), (x_TD, w_TK, ids_TK, owner_E, pad_P) = \
        [t.cpu() for t in outs], [t.cpu() for t in ins]
    x_ND = words_NW.view(torch.float32)
    for n in range(P * C):
        p, t = n // C, int(tok_N[n])
        assert int(meta_NM[n, 2 * K]) == int(counts_P[p])
        if t < 0:  # padding: zero x and weights, an id of an expert elsewhere
            assert not x_ND[n].any() and not meta_NM[n, :K].any()
            assert (meta_NM[n, K:2 * K] == pad_P[p]).all() and (owner_E[meta_NM[n, K:2 * K].long()] != p).all()
            continue
        assert int(row_PT[p, t]) == n
        assert torch.equal(x_ND[n], x_TD[t])
        here = owner_E[ids_TK[t].long()] == p
        assert here.any()
        torch.testing.assert_close(meta_NM[n, :K].view(torch.float32), torch.where(here, w_TK[t], 0.0))
        assert torch.equal(meta_NM[n, K:2 * K].long(), ids_TK[t].long())


@needs_triton_device
@pytest.mark.parametrize("N,K,C,ids_dtype", [(8, 2, 4, torch.int64), (27, 3, 9, torch.int32),
                                             (130, 8, 65, torch.int64)])
def test_unpack_triton_matches_reference(monkeypatch, N, K, C, ids_dtype):
    g = torch.Generator().manual_seed(N)
    meta_NM = torch.empty(N, 2 * K + 4, dtype=torch.int32)[:, :2 * K + 1]  # row-strided, as in the buffer
    meta_NM[:, :K] = torch.rand(N, K, generator=g).view(torch.int32)
    meta_NM[:, K:] = torch.randint(0, 1000, (N, K + 1), generator=g, dtype=torch.int32)
    meta_NM = meta_NM.to(DEV)
    outs = []
    for on in (True, False):
        _triton(monkeypatch, on)
        w = torch.full((N, K), float("nan"), device=DEV)
        ids = torch.full((N, K), -7, dtype=ids_dtype, device=DEV)
        counts = torch.full((N // C,), -7, dtype=torch.int64, device=DEV)
        ops.unpack(meta_NM, C, w, ids, counts)
        outs.append((w, ids, counts))
    for g_, w_ in zip(*outs):
        assert torch.equal(g_, w_)
    assert torch.equal(outs[1][2].cpu(), meta_NM[::C, 2 * K].long().cpu())


@needs_triton_device
@pytest.mark.parametrize("T,D,P,C,dtype", [(5, 24, 2, 5, torch.float32), (7, 40, 4, 9, torch.float32),
                                           (3, 600, 3, 4, torch.bfloat16)])
def test_combine_triton_matches_reference(monkeypatch, T, D, P, C, dtype):
    g = torch.Generator().manual_seed(T * D)
    back_ND = torch.randn(P * C, D, generator=g).to(DEV, dtype)
    goes_PT = torch.rand(P, T, generator=g) < 0.6
    row_PT = torch.where(goes_PT, torch.randint(0, P * C, (P, T), generator=g), P * C).to(DEV)
    outs = []
    for on in (True, False):
        _triton(monkeypatch, on)
        out = torch.full((T, D), float("nan"), device=DEV, dtype=dtype)
        ops.combine(back_ND, row_PT, out)
        outs.append(out)
    # fp32 bit-exact; bf16 within one rounding of the fp32 sum (the interpreter truncates).
    exact = dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], atol=0 if exact else 1e-2, rtol=0 if exact else 2 ** -7)
    want = sum(torch.where(goes_PT[p].to(DEV)[:, None], back_ND.float()[row_PT[p].clamp(max=P * C - 1)], 0.0)
               for p in range(P))
    torch.testing.assert_close(outs[1].float(), want, atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=1e-2)


# ---- the dispatcher on the Triton path -------------------------------------------------------

def _dispatcher_problem(T, D, E, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g).to(DEV, dtype)
    w_TK, ids_TK = torch.rand(T, E, generator=g).topk(K, dim=1)
    return x_TD, w_TK.softmax(dim=1).to(DEV), ids_TK.to(DEV)


def _fake_experts(recv):
    """A capturable stand-in for the experts: row * (sum of its weights)."""
    return (recv.x_RD.float() * recv.topk_weights_RK.sum(dim=1, keepdim=True)).to(recv.x_RD.dtype)


@needs_triton_device
@pytest.mark.parametrize("backend,T,C", [("low_latency", 0, 3), ("low_latency", 5, 5), ("low_latency", 9, 16),
                                         ("all_to_all", 0, None), ("all_to_all", 1, None), ("all_to_all", 9, None)])
def test_dispatcher_triton_path_matches_reference_path(monkeypatch, backend, T, C):
    from all2all import AllToAllDispatcher, LowLatencyDispatcher
    from kernels import fused_experts

    E, K, D = 8, 2, 24
    g = torch.Generator().manual_seed(1)
    w13, w2 = (torch.randn(E, 2 * 8, D, generator=g) * 0.2).to(DEV), (torch.randn(E, D, 8, generator=g) * 0.2).to(DEV)
    x_TD, w_TK, ids_TK = _dispatcher_problem(T, D, E, K, torch.float32)
    outs = []
    for on in (True, False):
        _triton(monkeypatch, on)
        disp = LowLatencyDispatcher(None, E, capacity=C) if backend == "low_latency" else AllToAllDispatcher(None, E)
        recv = disp.dispatch(x_TD, w_TK, ids_TK)
        y_RD = fused_experts(recv.x_RD.contiguous(), w13, w2, recv.topk_weights_RK, recv.topk_ids_RK,
                             expert_map=disp.expert_map_on(DEV), backend="torch")
        outs.append((recv.x_RD, recv.topk_weights_RK, recv.topk_ids_RK, disp.combine(y_RD, recv)))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(outs[0][3], fused_experts(x_TD, w13, w2, w_TK, ids_TK, backend="torch"),
                               atol=1e-5, rtol=1e-5)


@needs_cuda
def test_dispatcher_real_shapes_bf16():
    from all2all import LowLatencyDispatcher

    x_TD, w_TK, ids_TK = _dispatcher_problem(200, 7168, 256, 8, torch.bfloat16, seed=2)
    disp = LowLatencyDispatcher(None, 256, capacity=256, debug=True)
    recv = disp.dispatch(x_TD, w_TK, ids_TK)
    assert recv.num_rows == 256 and int(disp.received_counts(recv)[0]) == 200
    out = disp.combine(_fake_experts(recv), recv)
    want = (x_TD.float() * w_TK.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def _capture_and_replay(disp, experts, T, D, E, K, dtype, exact=True):
    """Capture dispatch -> experts -> combine, replay on new inputs, compare with an eager run
    (bit-exact unless the experts may accumulate in another order)."""
    x_TD, w_TK, ids_TK = _dispatcher_problem(T, D, E, K, dtype, seed=3)

    def step():
        recv = disp.dispatch(x_TD, w_TK, ids_TK)
        return disp.combine(experts(recv), recv)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compilation, cached tables
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_TD = step()
    new_x, new_w, new_ids = _dispatcher_problem(T, D, E, K, dtype, seed=4)
    x_TD.copy_(new_x)
    w_TK.copy_(new_w)
    ids_TK.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    recv = disp.dispatch(new_x, new_w, new_ids)
    tol = 0 if exact else 2e-2
    torch.testing.assert_close(out_TD, disp.combine(experts(recv), recv), atol=tol, rtol=tol)
    return out_TD, (new_x, new_w, new_ids)


@needs_cuda
def test_cuda_graph_capture_without_process_group():
    from all2all import LowLatencyDispatcher

    disp = LowLatencyDispatcher(None, 64, capacity=32)
    out_TD, (x, w, _) = _capture_and_replay(disp, _fake_experts, 24, 1024, 64, 4, torch.bfloat16)
    want = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)
    torch.testing.assert_close(out_TD.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("experts", ["fake", "triton"])
def test_cuda_graph_capture_on_nccl_group_of_one(experts):
    # "fake": the dispatcher alone must be capturable; "triton": also the expert kernel with an
    # expert_map, as the runner would capture it under EP.
    import torch.distributed as dist

    from all2all import LowLatencyDispatcher
    from kernels import fused_experts
    from tests.all2all.a2a_harness import free_port

    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    E, K, D, F = 64, 4, 1024, 128
    g = torch.Generator().manual_seed(5)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 0.05).to(DEV, torch.bfloat16)
    w2 = (torch.randn(E, D, F, generator=g) * 0.05).to(DEV, torch.bfloat16)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        disp = LowLatencyDispatcher(None, E, capacity=32)
        assert disp.ep_size == 1

        def triton_experts(recv):
            return fused_experts(recv.x_RD.contiguous(), w13, w2, recv.topk_weights_RK, recv.topk_ids_RK,
                                 expert_map=disp.expert_map_on(DEV), backend="triton")

        run = _fake_experts if experts == "fake" else triton_experts
        out_TD, (x, w, ids) = _capture_and_replay(disp, run, 24, D, E, K, torch.bfloat16,
                                                   exact=experts == "fake")
        if experts == "triton":
            want = fused_experts(x, w13, w2, w, ids, backend="torch")
            torch.testing.assert_close(out_TD.float(), want.float(), atol=3e-2, rtol=3e-2)
    finally:
        dist.destroy_process_group()


# ---- the variable-size rows of the all_to_all dispatcher --------------------------------------

def _pack_var_all(monkeypatch, on, T, K, E, P, seed):
    x_TD, weights_TK, ids_TK, owner_E, _ = (t.to(DEV) for t in _problem(T, K, E, P, seed))
    _triton(monkeypatch, on)
    row_PT, tok_N, counts_P = ops.route(ids_TK, owner_E, P, T)
    words_NW = torch.full((P * T, 6), -7, dtype=torch.int32, device=DEV)  # fp32 x as int32 words
    meta_NM = torch.full((P * T, 2 * K), -7, dtype=torch.int32, device=DEV)
    ops.pack_var(x_TD.view(torch.int32), weights_TK, ids_TK, owner_E, tok_N, counts_P, row_PT, words_NW, meta_NM)
    return (row_PT, counts_P, words_NW, meta_NM), (x_TD, weights_TK, ids_TK, owner_E)


@pytest.mark.parametrize("T,K,E,P", [(0, 2, 8, 2), (5, 2, 8, 2), (7, 3, 12, 4), (150, 4, 16, 2)])
def test_pack_var_rows_mean_what_they_say(monkeypatch, T, K, E, P):
    """The reference: each destination's tokens back to back in token order, their x, weights
    (zero for experts on other ranks) and ids; row_PT points at them; rows past S untouched."""
    (row_PT, counts_P, words_NW, meta_NM), (x_TD, w_TK, ids_TK, owner_E) = _pack_var_all(monkeypatch, False, T, K,
                                                                                          E, P, seed=2)
    row, oracle_counts = 0, []
    for p in range(P):
        toks = [t for t in range(T) if (owner_E[ids_TK[t].long()] == p).any()]
        oracle_counts.append(len(toks))
        for t in toks:
            assert int(row_PT[p, t]) == row
            assert torch.equal(words_NW[row].cpu(), x_TD[t].view(torch.int32).cpu())
            here = owner_E[ids_TK[t].long()] == p
            assert torch.equal(meta_NM[row, :K].view(torch.float32).cpu(), torch.where(here, w_TK[t], 0.0).cpu())
            assert torch.equal(meta_NM[row, K:].cpu(), ids_TK[t].to(torch.int32).cpu())
            row += 1
        assert all(int(row_PT[p, t]) == P * T for t in range(T) if t not in toks)
    assert counts_P.tolist() == oracle_counts
    assert (meta_NM[row:] == -7).all() and (words_NW[row:] == -7).all()


@needs_triton_device
@pytest.mark.parametrize("T,K,E,P", [(0, 2, 8, 2), (5, 2, 8, 2), (7, 3, 12, 4), (13, 1, 4, 4), (150, 4, 16, 2)])
def test_pack_var_triton_matches_reference(monkeypatch, T, K, E, P):
    got, _ = _pack_var_all(monkeypatch, True, T, K, E, P, seed=T + 3)
    want, _ = _pack_var_all(monkeypatch, False, T, K, E, P, seed=T + 3)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@needs_triton_device
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_unpack_var_triton_matches_reference(monkeypatch, ids_dtype):
    g = torch.Generator().manual_seed(4)
    R, K = 70, 3
    meta = torch.cat([torch.rand(R, K, generator=g).view(torch.int32), torch.randint(0, 9, (R, K), generator=g,
                                                                                       dtype=torch.int32)], 1)
    wide = torch.cat([meta, torch.zeros(R, 5, dtype=torch.int32)], 1).to(DEV)[:, :2 * K]  # row-strided
    outs = []
    for on in (True, False):
        _triton(monkeypatch, on)
        w = torch.full((R, K), float("nan"), device=DEV)
        ids = torch.full((R, K), -7, dtype=ids_dtype, device=DEV)
        ops.unpack_var(wide, w, ids)
        outs.append((w, ids))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[1][1].cpu(), meta[:, K:].to(ids_dtype))
