"""The crash matrix (tools/harness/crash_trial.py) across namespace nodes (tools/harness/netns_hosts.py).

The default suite runs one trial whose victim is a whole machine (every process of a node killed,
its shared memory gone, the node booted empty before the restart); the long run (every victim,
the partitioned link included, 3 nodes) is opt-in: ``pytest -m slow``. A trial passes when every
step a rank saw COMMITTED still loads bit-exact, nothing partial is visible, the restarted job
resumes bit-exact and commits, and nothing is left behind (see tools/harness/crash_trial.py).
"""

from __future__ import annotations

import pytest

from tools.harness import crash_trial as ct
from tools.harness.netns_hosts import NETNS_VICTIMS, NetnsHosts


@pytest.mark.timeout(150)
def test_short_netns_crash_matrix(netns_available, tmp_path):
    result = ct.run_trial(2000, NetnsHosts(), ranks=2, nodes=2, victim="machine", workdir=tmp_path)
    assert not ct.failures([result]), ct.failures([result])
    assert result.recovered and "machine" in result.victim_detail


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_long_netns_crash_matrix(netns_available, tmp_path):
    results = [
        ct.run_trial(seed, NetnsHosts(), ranks=3, nodes=3, workdir=tmp_path, victim=victim)
        for seed, victim in enumerate(NETNS_VICTIMS * 2 + (None,) * 6)
    ]
    assert not ct.failures(results), "\n".join(ct.failures(results))
    assert {r.victim for r in results} == set(NETNS_VICTIMS)
