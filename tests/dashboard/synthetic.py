"""Synthetic expert-load recordings with a skewed load (a few hot experts), for the dashboard tests.

Shape legend: L = MoE layers, E = experts, P = EP ranks.
"""
from __future__ import annotations

import numpy as np

from moe.expert_load.recording import ExpertLoadMeta, ExpertLoadWindow

LAYERS = [1, 3, 5, 7]  # decoder-layer indices of the MoE layers (not 0..L-1, so a mix-up shows)
NUM_EXPERTS = 16
EP_SIZE = 2
TOP_K = 4
WINDOW_STEPS = 8


T0 = 1.7e9  # unix time of window 0; window i closes WINDOW_S later each
WINDOW_S = 5.0


def make_meta(model: str = "synthetic/skewed-moe", ep_size: int = EP_SIZE) -> ExpertLoadMeta:
    return ExpertLoadMeta(model=model, layers=LAYERS, num_experts=NUM_EXPERTS, ep_size=ep_size,
                          num_physical_experts=NUM_EXPERTS, window_steps=WINDOW_STEPS)


def make_window(index: int, rng: np.random.Generator, tokens: int = 300, ep_size: int = EP_SIZE) -> ExpertLoadWindow:
    """One window: `tokens` tokens per layer, each routed to TOP_K distinct experts drawn with a Zipf-like
    skew whose hot experts differ per layer; experts live on ranks contiguously (E / P each)."""
    L, E, P = len(LAYERS), NUM_EXPERTS, ep_size
    counts_LE = np.zeros((L, E), dtype=np.int64)
    for l in range(L):
        weights_E = 1.0 / (1.0 + np.arange(E)) ** 1.2
        prob_E = np.roll(weights_E, 3 * l + index % 2)
        prob_E /= prob_E.sum()
        n = tokens + int(rng.integers(0, 50))
        for _ in range(n):
            counts_LE[l, rng.choice(E, size=TOP_K, replace=False, p=prob_E)] += 1
    per_rank_LP = counts_LE.reshape(L, P, E // P).sum(axis=2)
    step_start = index * WINDOW_STEPS
    return ExpertLoadWindow.build(index, step_start, step_start + WINDOW_STEPS, T0 + WINDOW_S * index, counts_LE,
                                  per_rank_LP)


def imbalance(counts_LE: np.ndarray) -> np.ndarray:
    """[L] max / mean over each layer's experts (NaN for a layer without tokens), computed independently."""
    counts_LE = np.asarray(counts_LE, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return counts_LE.max(axis=1) / counts_LE.mean(axis=1)


def hottest(counts_LE: np.ndarray, n: int = 10) -> list[tuple[int, int, int, float]]:
    """(row, expert, count, share of the row) of the n largest counts; ties to the lower row, then expert."""
    cells = [(int(c), r, e) for (r, e), c in np.ndenumerate(counts_LE) if c > 0]
    cells.sort(key=lambda t: (-t[0], t[1], t[2]))
    return [(r, e, c, c / int(counts_LE[r].sum())) for c, r, e in cells[:n]]
