"""The expert-load counting kernels (kernels/expert_count.py): Triton under the interpreter and
the torch reference against numpy, with padding rows, tensor-parallel row offsets and rows that
are (token, expert) pairs; the EPLB replica map and move plan (models/layers/expert_replicas.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.expert_count as ec
from models.layers.expert_replicas import ExpertReplicas, plan_moves


def _device(monkeypatch, triton_path: bool) -> torch.device:
    """Where the Triton path runs: the GPU, or the CPU under the interpreter (tests/kernels/conftest.py)."""
    if triton_path and torch.cuda.is_available():
        return torch.device("cuda")
    if triton_path:
        monkeypatch.setattr(ec, "_use_triton", lambda t: True)
    elif torch.cuda.is_available():
        monkeypatch.setattr(ec, "_use_triton", lambda t: False)  # the reference, on CPU tensors anyway
    return torch.device("cpu")


def _expected_counts(ids_TK, E, num_valid, row_offset, rows_per_token):
    T, K = ids_TK.shape
    rows = (np.arange(T) + row_offset) // rows_per_token < num_valid
    return np.bincount(ids_TK[rows].reshape(-1), minlength=E)


@pytest.mark.parametrize("T,K,E,num_valid,row_offset,rpt", [
    (7, 2, 8, 7, 0, 1), (9, 4, 16, 5, 0, 1), (6, 1, 4, 0, 0, 1), (8, 3, 8, 10, 3, 1), (12, 1, 8, 3, 0, 2),
    (0, 2, 4, 0, 0, 1)])
@pytest.mark.parametrize("triton_path", [False, True])
def test_count_experts(monkeypatch, T, K, E, num_valid, row_offset, rpt, triton_path):
    dev = _device(monkeypatch, triton_path)
    g = torch.Generator().manual_seed(T * 31 + K)
    ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
    counts = torch.full((E,), 5, dtype=torch.int64, device=dev)  # counts add to what is there
    ec.count_experts(ids.to(dev), counts, torch.tensor([num_valid], device=dev), row_offset, rpt)
    want = 5 + _expected_counts(ids.numpy(), E, num_valid, row_offset, rpt)
    assert counts.tolist() == want.tolist()


@pytest.mark.parametrize("L,T,K,E,num_valid", [(3, 7, 2, 8, 5), (4, 16, 8, 128, 16), (2, 5, 1, 4, 0)])
@pytest.mark.parametrize("triton_path", [False, True])
def test_count_layers_counts_every_layer_in_one_call(monkeypatch, L, T, K, E, num_valid, triton_path):
    dev = _device(monkeypatch, triton_path)
    g = torch.Generator().manual_seed(L * 7 + T)
    buf = torch.randint(0, E, (L, T + 3, K), generator=g, dtype=torch.int32)  # rows past T: not this step's
    counts = torch.full((L, E), 2, dtype=torch.int64)
    want = counts.numpy().copy()
    for layer in range(L):
        want[layer] += np.bincount(buf[layer, :num_valid].reshape(-1).numpy(), minlength=E)
    counts = counts.to(dev)
    ec.count_layers(buf.to(dev)[:, :T], counts, torch.tensor([num_valid], device=dev))
    assert counts.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("triton_path", [False, True])
def test_map_to_physical_spreads_over_replicas_and_counts_both(monkeypatch, triton_path):
    dev = _device(monkeypatch, triton_path)
    E, P, T = 4, 7, 10
    phys_to_log = [0, 1, 2, 3, 0, 0, 2]  # expert 0 has three slots, expert 2 two
    rep = ExpertReplicas(phys_to_log, E, dev)
    ids = torch.tensor([[0, 2]] * T, dtype=torch.int64, device=dev)
    log_c, phys_c = torch.zeros(E, dtype=torch.int64, device=dev), torch.zeros(P, dtype=torch.int64, device=dev)
    phys = ec.map_to_physical_and_count(ids, rep.log_to_phys_ER, rep.replica_count_E, log_c, phys_c,
                                        torch.tensor([6], device=dev), row_offset=0)
    assert all(phys_to_log[p] == e for p, e in zip(phys.reshape(-1).tolist(), ids.reshape(-1).tolist()))
    # row t takes replica t % count: K = 2 shares a factor with expert 2's two slots, yet both are used
    assert phys[:, 0].tolist() == [[0, 4, 5][t % 3] for t in range(T)]
    assert phys[:, 1].tolist() == [[2, 6][t % 2] for t in range(T)]
    assert log_c.tolist() == [6, 0, 6, 0]  # only the 6 valid rows
    assert phys_c.sum().item() == 12 and phys_c[[0, 4, 5]].sum().item() == 6 and phys_c[[0, 4, 5]].min() > 0


def test_replica_map_rejects_a_placement_that_drops_an_expert():
    with pytest.raises(ValueError, match=r"logical experts \[3\] have no physical slot"):
        ExpertReplicas([0, 1, 2, 2], 4, torch.device("cpu"))


def test_plan_moves_prefers_a_local_copy():
    old, new = [0, 1, 2, 3, 0, 1], [0, 1, 0, 3, 2, 1]  # 3 slots per rank
    assert plan_moves(old, new, 3) == [(0, 2), (2, 4)]  # slot 2 copies rank 0's own 0; slot 4 gets 2 from rank 0




@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_counts_in_a_graph_skip_padding_rows():
    """On the GPU, captured once at a padded size: each replay counts only num_valid rows."""
    E, T, K = 128, 64, 8
    dev = torch.device("cuda")
    ids = torch.randint(0, E, (T, K), device=dev, dtype=torch.int32)
    counts = torch.zeros(E, dtype=torch.int64, device=dev)
    num_valid = torch.zeros(1, dtype=torch.int64, device=dev)
    ec.count_experts(ids, counts, num_valid)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ec.count_experts(ids, counts, num_valid)
    want = np.zeros(E, dtype=np.int64)
    for n in (64, 5, 0, 33):
        num_valid.fill_(n)
        graph.replay()
        want += np.bincount(ids[:n].reshape(-1).cpu().numpy(), minlength=E)
    torch.cuda.synchronize()
    assert counts.cpu().tolist() == want.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_map_to_physical_equals_the_reference():
    E, P, T, K = 64, 80, 300, 8
    phys_to_log = list(range(E)) + list(range(16))
    dev = torch.device("cuda")
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(dev)
    out = []
    for device in (dev, torch.device("cpu")):
        rep = ExpertReplicas(phys_to_log, E, device)
        lc, pc = torch.zeros(E, dtype=torch.int64, device=device), torch.zeros(P, dtype=torch.int64, device=device)
        phys = ec.map_to_physical_and_count(ids.to(device), rep.log_to_phys_ER, rep.replica_count_E, lc, pc,
                                            torch.tensor([250], device=device), row_offset=7)
        out.append((phys.cpu(), lc.cpu(), pc.cpu()))
    for a, b in zip(*out):
        assert torch.equal(a, b)
