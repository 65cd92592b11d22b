"""make_dispatcher: the `auto` rule and the error messages (single process, no collectives)."""
from __future__ import annotations

from math import comb

import pytest
import torch

from all2all import (
    AUTO_A2A_MAX_BYTES_RATIO,
    DISPATCHER_BACKENDS,
    LocalDispatcher,
    low_latency_for_auto,
    choose_backend,
    expected_distinct_ranks,
    make_dispatcher,
)


def test_expected_distinct_ranks_matches_closed_form_and_sampling():
    assert expected_distinct_ranks(16, 4, 1) == pytest.approx(1.0)
    assert expected_distinct_ranks(16, 1, 5) == pytest.approx(1.0)
    assert expected_distinct_ranks(256, 8, 8) == pytest.approx(8 * (1 - comb(224, 8) / comb(256, 8)))
    g = torch.Generator().manual_seed(0)
    ids_TK = torch.rand(20000, 64, generator=g).topk(4, dim=1).indices
    sampled = (ids_TK // 16).sort(dim=1).values.diff(dim=1).ne(0).sum(dim=1).add(1).float().mean()
    assert expected_distinct_ranks(64, 4, 4) == pytest.approx(float(sampled), rel=0.02)


@pytest.mark.parametrize("ep, E, k, want", [
    (1, 256, 8, "local"),
    (2, 256, 8, "allgather_reducescatter"),  # m/P ~ 1: every token goes to both ranks
    (4, 256, 8, "allgather_reducescatter"),  # m/P ~ 0.90
    (8, 256, 8, "all_to_all"),               # m/P ~ 0.66
    (2, 16, 1, "all_to_all"),                # top-1 (Llama-4): m/P = 0.5
    (16, 256, 8, "all_to_all"),
])
def test_auto_uniform_estimate(ep, E, k, want):
    assert choose_backend(ep, E, top_k=k) == want


def test_auto_hint_overrides_estimate():
    # DeepSeek-V3 group-limited routing, one expert group per rank at EP=8: <= 4 ranks per token.
    assert choose_backend(8, 256, top_k=8, expected_ranks_per_token=4) == "all_to_all"
    assert choose_backend(2, 256, top_k=1, expected_ranks_per_token=2) == "allgather_reducescatter"
    at_threshold = 4 * AUTO_A2A_MAX_BYTES_RATIO
    assert choose_backend(4, 256, expected_ranks_per_token=at_threshold) == "all_to_all"


def test_auto_errors():
    with pytest.raises(ValueError, match="top_k .*expected_ranks_per_token"):
        choose_backend(4, 256)
    with pytest.raises(ValueError, match=r"expected_ranks_per_token must be in \(0, 4\]"):
        choose_backend(4, 256, expected_ranks_per_token=5)
    with pytest.raises(ValueError, match="top_k must be in"):
        expected_distinct_ranks(16, 2, 17)


def test_unknown_backend_lists_choices():
    with pytest.raises(ValueError) as info:
        make_dispatcher("deepep", None, 16)
    for name in DISPATCHER_BACKENDS:
        assert name in str(info.value)


def test_auto_is_low_latency_on_cuda_only():
    assert low_latency_for_auto("cuda") and not low_latency_for_auto("cpu")
    # one process: nothing to dispatch, whatever the device
    assert isinstance(make_dispatcher("auto", None, 16, auto_low_latency=True), LocalDispatcher)


def test_single_process_dispatchers():
    assert isinstance(make_dispatcher("auto", None, 16), LocalDispatcher)  # EP=1 needs no hint
    for backend in ("allgather_reducescatter", "all_to_all"):
        assert make_dispatcher(backend, None, 16).ep_size == 1


def test_bad_placement_and_args():
    with pytest.raises(ValueError, match="placement must be one of"):
        make_dispatcher("local", None, 16, placement="random")
    disp = make_dispatcher("local", None, 16)
    with pytest.raises(ValueError, match="topk_ids must be"):
        disp.dispatch(torch.zeros(3, 4), torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        disp.dispatch(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(2, 2))
