"""Where the Triton kernel tests run: on a GPU, or on the CPU through the interpreter (which
tests/kernels/conftest.py turns on when there is no GPU), and which combinations of their parameters
run there (kernel_grid: the interpreter takes seconds a combination, so CI runs a covering subset of a
cross product and the GPU stages the whole of it)."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton_device = pytest.mark.skipif(not (CUDA or INTERPRET), reason="no GPU and TRITON_INTERPRET is not set")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def kernel_grid(*axes: dict, cover: str = "pairs") -> list:
    """Parameter combinations of a Triton kernel test, each axis {id: value}: on a GPU (milliseconds a
    combination) every combination; under the interpreter (seconds a combination) a covering subset:
    cover="pairs", every pair of values of any two axes in some combination; "values", every value of
    every axis in some combination; "all", every combination there too. For axes that select
    independent parts of a kernel; the GPU stages run the whole product."""
    if cover not in ("pairs", "values", "all"):
        raise ValueError(f"cover must be 'pairs', 'values' or 'all', got {cover!r}")
    sizes = [len(a) for a in axes]
    rows = list(itertools.product(*map(range, sizes)))
    if INTERPRET and not CUDA and len(axes) > 1 and cover != "all":
        rows = _covering_rows(sizes, pairs=cover == "pairs")
    names, values = [list(a) for a in axes], [list(a.values()) for a in axes]
    return [pytest.param(*(v[i] for v, i in zip(values, row)), id="-".join(n[i] for n, i in zip(names, row)))
            for row in rows]


def _pairs(row: tuple[int, ...]) -> set[tuple[int, int, int, int]]:
    """(axis a, its value, axis b, its value) for every two axes a < b of a combination."""
    return {(a, row[a], b, row[b]) for a, b in itertools.combinations(range(len(row)), 2)}


def _covering_rows(sizes: list[int], pairs: bool) -> list[tuple[int, ...]]:
    if not pairs:  # combination i takes value i of each axis, cycling the shorter ones
        return [tuple(i % n for n in sizes) for i in range(max(sizes))]
    every = list(itertools.product(*map(range, sizes)))
    todo = set().union(*map(_pairs, every))
    rows = []
    while todo:  # greedily, the combination that covers the most pairs still missing (the first on ties)
        row = max(every, key=lambda r: len(_pairs(r) & todo))
        rows.append(row)
        todo -= _pairs(row)
    return rows
