"""kernel_grid: the parameter combinations of the Triton kernel tests (the whole product on a GPU, a
covering subset under the interpreter)."""
from __future__ import annotations

import itertools

import pytest

import tests.kernels.triton_marks as marks


def pairs_of(rows):
    return {(a, r[a], b, r[b]) for r in rows for a, b in itertools.combinations(range(len(r)), 2)}


@pytest.mark.parametrize("sizes", [[2, 2, 4], [4, 2, 2], [3, 5], [2, 3, 3, 2], [5, 1, 2]])
def test_pairs_cover_every_pair_and_values_every_value(sizes):
    rows = marks._covering_rows(sizes, pairs=True)
    assert pairs_of(rows) == pairs_of(itertools.product(*map(range, sizes)))
    assert len(rows) == len(set(rows)) <= max(a * b for a, b in itertools.combinations(sorted(sizes), 2)) + 2
    rows = marks._covering_rows(sizes, pairs=False)
    assert len(rows) == max(sizes)
    assert all({r[a] for r in rows} == set(range(n)) for a, n in enumerate(sizes))


def test_three_axes_take_fewer_than_the_product():
    assert len(marks._covering_rows([2, 2, 4], pairs=True)) == 8  # of 16; a pair of axes 2 x 4 needs 8


@pytest.mark.parametrize("interpret,cuda,cover,want", [
    (True, False, "pairs", 4), (True, False, "values", 2), (True, False, "all", 8),
    (False, True, "pairs", 8), (True, True, "values", 8)])
def test_the_product_on_a_gpu_and_a_subset_only_under_the_interpreter(monkeypatch, interpret, cuda, cover, want):
    monkeypatch.setattr(marks, "INTERPRET", interpret)
    monkeypatch.setattr(marks, "CUDA", cuda)
    params = marks.kernel_grid({"a": 1, "b": 2}, {"x": "X", "y": "Y"}, {"p": None, "q": {}}, cover=cover)
    assert len(params) == want
    first = params[0]
    assert first.id == "a-x-p" and first.values == (1, "X", None)
    assert len({p.id for p in params}) == want


def test_an_unknown_cover_is_refused():
    with pytest.raises(ValueError, match="cover must be"):
        marks.kernel_grid({"a": 1}, {"x": 2}, cover="pair")
