"""The crash matrix (tests/fault/crash_trial.py) across namespace nodes (tests/netns/crash_hosts.py).

The default suite runs one trial whose victim is a whole machine (every process of a node killed,
its shared memory gone, the node booted empty before the restart); the long run (every victim,
the partitioned link included, 3 nodes) is opt-in: ``pytest -m slow``. A trial passes when every
step a rank saw COMMITTED still loads bit-exact, nothing partial is visible, the restarted job
resumes bit-exact and commits, and nothing is left behind (see tests/fault/crash_trial.py).
"""

from __future__ import annotations

import pytest

from tests.fault import crash_trial as ct

from .crash_hosts import NETNS_VICTIMS, NetnsHosts


def _failures(results: list[ct.TrialResult]) -> list[str]:
    return [
        f"seed {r.seed} ({r.victim_detail}): corrupt={r.corrupt} lost={r.lost_committed} problems={r.problems}"
        for r in results
        if not r.ok
    ]


@pytest.mark.timeout(150)
def test_short_netns_crash_matrix(netns_available, tmp_path):
    result = ct.run_trial(2000, NetnsHosts(), ranks=2, nodes=2, victim="machine", workdir=tmp_path)
    assert not _failures([result]), _failures([result])
    assert result.recovered and "machine" in result.victim_detail


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_long_netns_crash_matrix(netns_available, tmp_path):
    results = [
        ct.run_trial(seed, NetnsHosts(), ranks=3, nodes=3, workdir=tmp_path, victim=victim)
        for seed, victim in enumerate(NETNS_VICTIMS * 2 + (None,) * 6)
    ]
    assert not _failures(results), "\n".join(_failures(results))
    assert {r.victim for r in results} == set(NETNS_VICTIMS)
