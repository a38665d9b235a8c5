import math

import pytest

from ckptd.errors import CkptdError
from ckptd.tune import TuneInputs, daly_interval, overhead_fraction, recommend


def test_young_daly_formula_and_optimality():
    inp = TuneInputs(stall_s=0.5, persist_s=20.0, mtbf_s=6 * 3600.0)
    rec = recommend(inp)
    assert rec.young_s == pytest.approx(math.sqrt(2 * 0.5 * 6 * 3600))
    r = 0.5 / (2 * 6 * 3600)
    expected_daly = math.sqrt(2 * 0.5 * 6 * 3600) * (1 + math.sqrt(r) / 3 + r / 9) - 0.5
    assert rec.daly_s == pytest.approx(expected_daly)
    assert rec.interval_s == pytest.approx(expected_daly)
    assert not rec.bound_by_persist
    # The recommendation is (close to) the minimum of the overhead model.
    best = min(overhead_fraction(t, inp) for t in [rec.interval_s * f for f in (0.5, 0.8, 1.25, 2.0)])
    assert rec.overhead_fraction <= best


def test_never_shorter_than_persist_and_rounded_to_steps():
    inp = TuneInputs(stall_s=0.01, persist_s=30.0, mtbf_s=3600.0, step_s=0.7)
    rec = recommend(inp)
    assert rec.bound_by_persist
    assert rec.interval_steps == math.ceil(30.0 / 0.7)
    assert rec.interval_s >= 30.0
    assert "never queue" in rec.explain(inp)


def test_daly_falls_back_to_mtbf_for_huge_costs():
    assert daly_interval(10.0, 4.0) == 4.0


@pytest.mark.parametrize("bad", [dict(mtbf_s=0), dict(stall_s=-1), dict(step_s=0)])
def test_bad_inputs_are_clear_errors(bad):
    base = dict(stall_s=1.0, persist_s=1.0, mtbf_s=100.0)
    base.update(bad)
    with pytest.raises(CkptdError, match="tune:"):
        recommend(TuneInputs(**base))
