"""The save-interval recommendation, checked against known values and properties, never against a
restatement of the formulas in ckptd.tune."""

import math

import pytest

from ckptd.errors import CkptdError
from ckptd.tune import TuneInputs, daly_interval, overhead_fraction, recommend


def _argmin(f, lo: float, hi: float) -> float:
    """Where the unimodal ``f`` is smallest in [lo, hi] (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    while b - a > 1e-9 * hi:
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def test_overhead_model_known_value():
    # stall 1 s every 100 s, plus (half an interval + 10 s commit + 0 s restart) lost per failure
    # every 1000 s: 1/100 + 60/1000.
    inp = TuneInputs(stall_s=1.0, persist_s=10.0, mtbf_s=1000.0)
    assert overhead_fraction(100.0, inp) == pytest.approx(0.07)
    assert overhead_fraction(100.0, TuneInputs(1.0, 10.0, 1000.0, restart_s=40.0)) == pytest.approx(0.11)


@pytest.mark.parametrize("stall_s, mtbf_s", [(0.5, 6 * 3600.0), (0.01, 3600.0), (20.0, 86400.0)])
def test_young_interval_is_where_the_overhead_model_is_smallest(stall_s, mtbf_s):
    inp = TuneInputs(stall_s=stall_s, persist_s=0.0, mtbf_s=mtbf_s)
    best = _argmin(lambda t: overhead_fraction(t, inp), 1e-3, mtbf_s)
    assert recommend(inp).young_s == pytest.approx(best, rel=1e-6)


def test_daly_interval_known_values():
    # Daly (2006): sqrt(2δM)(1 + sqrt(δ/2M)/3 + (δ/2M)/9) - δ. With δ = M/2 the root is M and
    # δ/2M = 1/4: M(1 + 1/6 + 1/36) - M/2 = 25M/36; with δ = M/8: M/2 (1 + 1/12 + 1/144) - M/8
    # = 121M/288.
    assert daly_interval(18.0, 36.0) == pytest.approx(25.0)
    assert daly_interval(36.0, 288.0) == pytest.approx(121.0)
    assert daly_interval(0.5, 6 * 3600.0) == pytest.approx(146.636240236863)  # bc -l, 12 digits
    # δ >= 2M: one interval of M (the series no longer applies).
    assert daly_interval(10.0, 4.0) == 4.0
    assert daly_interval(8.0, 4.0) == 4.0


def test_recommendation_for_a_typical_job():
    inp = TuneInputs(stall_s=0.5, persist_s=20.0, mtbf_s=6 * 3600.0)
    rec = recommend(inp)
    assert rec.young_s == pytest.approx(146.969384566990)  # sqrt(21600), bc -l
    assert rec.daly_s == pytest.approx(146.636240236863)
    assert rec.interval_s == rec.daly_s and rec.interval_steps is None and not rec.bound_by_persist
    # A small stall against the MTBF: Daly's correction is small, and the recommendation is (close
    # to) the minimum of the overhead model.
    assert abs(rec.daly_s - rec.young_s) / rec.young_s < math.sqrt(inp.stall_s / inp.mtbf_s)
    assert all(rec.overhead_fraction <= overhead_fraction(rec.interval_s * f, inp) for f in (0.5, 0.8, 1.25, 2.0))
    assert rec.overhead_fraction == pytest.approx(overhead_fraction(rec.interval_s, inp))


def test_never_shorter_than_persist_and_rounded_to_steps():
    inp = TuneInputs(stall_s=0.01, persist_s=30.0, mtbf_s=3600.0, step_s=0.7)
    rec = recommend(inp)
    assert rec.bound_by_persist and rec.daly_s < 30.0
    assert rec.interval_steps == 43  # 30 s / 0.7 s = 42.86 steps, rounded up
    assert rec.interval_s == pytest.approx(43 * 0.7) and rec.interval_s >= 30.0
    assert "never queue" in rec.explain(inp)


@pytest.mark.parametrize(
    "bad",
    [
        {"mtbf_s": 0},
        {"stall_s": -1},
        {"step_s": 0},
        {"stall_s": math.nan},  # recommended 1.0 s with a "nan%" overhead
        {"mtbf_s": math.nan},
        {"mtbf_s": math.inf, "step_s": 1.0},  # an OverflowError traceback
    ],
)
def test_bad_inputs_are_clear_errors(bad):
    base = {"stall_s": 1.0, "persist_s": 1.0, "mtbf_s": 100.0}
    base.update(bad)
    with pytest.raises(CkptdError, match="tune:"):
        recommend(TuneInputs(**base))


def test_nothing_measured_is_an_error():
    with pytest.raises(CkptdError, match="measure a save first"):
        recommend(TuneInputs(stall_s=0.0, persist_s=0.0, mtbf_s=100.0))


def test_nothing_measured_is_refused_also_with_a_step_time():
    """Stall and persist 0 with a step time: it recommended a save at every step."""
    with pytest.raises(CkptdError, match="measure a save first"):
        recommend(TuneInputs(stall_s=0.0, persist_s=0.0, mtbf_s=1000.0, step_s=0.5))
