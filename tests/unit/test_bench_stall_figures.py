"""The training loop's stall figures (pure): the steady "median" of two saves is their median
(their mean), not the larger of them, and saves inside the ring's pinning are counted apart."""

from __future__ import annotations

import pytest

from benchmarks.trainloop import stall_figures


def test_the_median_of_two_steady_saves_is_their_mean_not_the_max() -> None:
    phases = [
        {"plan_s": 0.5, "copy_s": 0.0, "handoff_s": 0.0},
        {"plan_s": 0.1, "copy_s": 0.2, "handoff_s": 0.0},
        {"plan_s": 0.3, "copy_s": 0.4, "handoff_s": 0.0},
    ]
    out = stall_figures([0.9, 0.1, 0.3], None, [0.0, 0.02, 0.1], phases)
    assert out["first_stall_s"] == 0.9
    assert out["stall_s_median"] == pytest.approx(0.2)
    assert out["stall_s_own_median"] == pytest.approx((0.08 + 0.2) / 2)
    assert out["steady_phases_s"] == pytest.approx({"plan_s": 0.2, "copy_s": 0.3, "handoff_s": 0.0})
    assert out["stall_s_max"] == 0.3


def test_saves_inside_the_pinning_are_not_steady() -> None:
    out = stall_figures([0.9, 0.6, 0.1, 0.2, 0.4], [True, True, False, False, False], None, None)
    assert out["saves_in_pinning"] == 1 and out["stall_s_in_pinning_max"] == 0.6
    assert out["stall_s_median"] == pytest.approx(0.2)
    out = stall_figures([0.9, 0.6], [True, True], None, None)
    assert "stall_s_median" not in out and out["saves_in_pinning"] == 1
