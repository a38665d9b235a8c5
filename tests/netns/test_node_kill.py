"""A whole node killed mid-save (every process in its namespaces: trainer, snapshot child, daemon,
and on node 0 the coordinator; its /dev/shm and runtime directory vanish with them), then
restarted as a launcher restarts a job: the killed node boots empty, every rank is launched anew.

- the surviving rank's save aborts within the bounds, naming the dead rank (node 1 killed) or
  the silent coordinator (node 0 killed); nothing of the step commits;
- after the restart every rank resumes from step 1, bit-exact, and the next save commits on every
  rank; the killed save's files are removed (by the coordinator, or by its successor, which adopts
  them and drops them after the commit timeout).

The default suite kills node 0 (the harder case: the coordinator goes with it); killing node 1 is
behind the slow marker (the crash matrix's short run in the default suite kills a node too).
"""

from __future__ import annotations

import pytest

from .job import wait_until


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 0], ids=["node1", "node0-coordinator"])
def test_whole_node_killed_mid_save(make_job, victim):
    job = make_job(2)
    survivor = 1 - victim
    job.save(1)
    job.committed(1)
    job.fault(victim, "delay 2")  # the victim's data file waits 2 s: it is killed while persisting
    job.save(2)
    wait_until(lambda: (job.status(victim) or {}).get("jobs_in_flight"), 10, f"node {victim} to persist step 2")
    job.cluster.nodes[victim].kill()
    [out] = job.outcomes(2, ranks=[survivor], timeout_s=30)
    why = "ranks [1] did not report within 4 s" if victim == 1 else "did not answer"
    assert out["outcome"] == "aborted" and why in out["reason"], out
    assert not (job.root / "iter_0000002").exists()

    job.fault(victim, "")
    job.cluster.nodes[victim].boot()  # empty /dev/shm and runtime directory, as after a reboot
    job.launch()  # the launcher restarts every rank (a new launch: new save attempts)
    if victim == 0:
        # Node 1's daemon outlived the coordinator; it learns the new one at its next ping (a
        # report sent before that would be taken for one the old coordinator lost).
        wait_until(
            lambda: job.status(1)["upstream"]["instance"] == job.status(0)["instance"],
            10,
            "node 1 to know the restarted coordinator",
        )
    assert [o["latest"] for o in job.call("latest")] == [1, 1]
    job.check(1)
    job.save(3)
    job.committed(3)
    job.check(3)
    wait_until(
        lambda: not [p for p in job.root.iterdir() if p.name.endswith(".tmp")],
        20,
        "the killed save's files to be removed",
    )
    assert sorted(p.name for p in job.root.glob("iter_*")) == ["iter_0000001", "iter_0000003"]
