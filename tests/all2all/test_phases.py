"""all2all/phases.py: the phase timer and the medians the bench reports."""
from __future__ import annotations

import pytest

from all2all.phases import PhaseTimer, median_phases


def test_marks_become_consecutive_phases_on_the_cpu():
    timer = PhaseTimer("cpu")
    with pytest.raises(RuntimeError, match="before start"):
        timer.mark("pack")
    timer.start()
    timer.mark("pack")
    timer.mark("transfer")
    phases = timer.phases()
    assert [n for n, _, _ in phases] == ["pack", "transfer"]
    assert all(h >= 0 and d is None for _, h, d in phases)


def test_median_phases_sums_repeats_and_fills_missing_with_zero():
    runs = [[("pack", 1.0, 10.0), ("transfer", 5.0, 50.0)],
            [("pack", 3.0, 30.0), ("transfer", 7.0, 70.0), ("pack", 1.0, 1.0)],
            [("pack", 2.0, 20.0)]]
    out = median_phases(runs)
    assert list(out) == ["pack", "transfer"]
    assert out["pack"] == {"host_us": 2.0, "device_us": 20.0}
    assert out["transfer"] == {"host_us": 5.0, "device_us": 50.0}
    assert median_phases([[("sync", 4.0, None)]])["sync"] == {"host_us": 4.0, "device_us": None}
