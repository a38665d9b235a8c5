"""Faults of the network between nodes, in each window of a save (namespace nodes, real daemons).

Each test hits its window by watching the daemons' status (and slows a daemon's disk with its
fault file where a window must last), takes a link down or partitions a node off, heals it, and
requires: nothing partial commits, the checkpoint the ranks last saw committed stays latest (or
the one that did commit is complete) and loads bit-exact, every rank's save ends within the
configured bounds with a reason, and the first save after the heal commits on every rank.

- link down on node 1 while it persists (longer than the coordinator timeout): the step aborts on
  both ranks, its files are removed, step 1 stays latest; then, on the same job, link down on
  node 1 while the coordinator commits, for longer than the coordinator timeout: the commit
  completes (it needs only the shared filesystem). Node 1 asks the root once the coordinator is
  silent for the timeout: held before its commit point (the metadata's write hangs), the step is
  not committed then, and node 1's rank is told its save aborted, with a reason saying the step
  may still commit (the known limit: a rank's ABORTED after a lost coordinator is not a promise
  that nothing committed); held after it (the tracker's write hangs), node 1's rank is told
  COMMITTED, with a warning that the coordinator did not answer;
- node 1 partitioned off between its WRITTEN and the coordinator's COMMITTED, for longer than the
  link timeout (so the connection is replaced and the verdict in it lost) but shorter than the
  coordinator timeout: once healed, node 1 resends its report and learns the verdict: every rank
  sees COMMITTED;
- node 0 (the coordinator's) partitioned off inside the network while the other nodes keep saving:
  every save of the partition aborts everywhere in bounded time; the partition lasts long enough
  (about 16 s) for TCP's retransmission back-off to exceed the commit timeout, and still the first
  save after the heal commits on every rank (the daemons replace a silent connection instead of
  waiting for TCP).
"""

from __future__ import annotations

import pytest

from .job import NetnsJob, wait_until

LINK_TIMEOUT_S = 1.0  # of the FAST settings (tests/netns/conftest.py): max(4 x 0.1, 3 / 3)


def _steps_on_disk(job: NetnsJob) -> list[str]:
    return sorted(p.name for p in job.root.iterdir() if p.name.startswith("iter_"))


def _no_partial_saves(job: NetnsJob) -> bool:
    return not [n for n in _steps_on_disk(job) if n.endswith(".tmp")]


def _latest_everywhere(job: NetnsJob, step: int) -> None:
    assert [o["latest"] for o in job.call("latest")] == [step] * job.world
    job.check(step)


@pytest.mark.timeout(150)
def test_link_down_during_persist_then_during_commit(make_job):
    job = make_job(2)
    job.save(1)
    job.committed(1)

    # --- persist: node 1's data file waits 2 s to be opened; its link goes down meanwhile
    job.fault(1, "delay 2")
    job.save(2)
    wait_until(lambda: (job.status(1) or {}).get("jobs_in_flight"), 10, "node 1 to persist step 2")
    job.cluster.nodes[1].link_down()
    job.fault(1, "")
    out = job.outcomes(2, timeout_s=30)
    assert out[0]["outcome"] == "aborted" and "ranks [1] did not report within 4 s" in out[0]["reason"], out
    assert out[1]["outcome"] == "aborted" and "did not answer" in out[1]["reason"], out
    _latest_everywhere(job, 1)
    job.cluster.nodes[1].link_up()
    wait_until(lambda: _no_partial_saves(job), 15, "the aborted step's files to be removed")
    job.save(3)
    job.committed(3)
    _latest_everywhere(job, 3)
    assert _steps_on_disk(job) == ["iter_0000001", "iter_0000003"]

    # --- commit, held before its commit point (metadata.json's write hangs); node 1's link goes
    # down for longer than the coordinator timeout: the root holds no commit when node 1 asks
    job.fault(0, "hang metadata.json.tmp")
    job.save(4)
    wait_until(
        lambda: any(s["phase"] == "committing" for s in job.coordinator_steps().values()),
        15,
        "the coordinator to commit step 4",
    )
    job.cluster.nodes[1].link_down()
    (out1,) = job.outcomes(4, ranks=[1], timeout_s=30)
    job.fault(0, "")
    (out0,) = job.outcomes(4, ranks=[0], timeout_s=30)
    assert out0["outcome"] == "committed", out0
    assert out1["outcome"] == "aborted" and "did not answer" in out1["reason"], out1
    assert "the root holds no commit of this attempt now" in out1["reason"] and "may still commit" in out1["reason"]
    job.cluster.nodes[1].link_up()
    _latest_everywhere(job, 4)  # the commit is complete and durable: every rank loads it bit-exact

    # --- commit, held after its commit point (the tracker's write hangs); node 1's link goes down
    # for longer than the coordinator timeout: node 1 finds the commit in the root
    job.fault(0, "hang latest.tmp")
    job.save(5)
    wait_until(lambda: (job.root / "iter_0000005").is_dir(), 15, "the coordinator to rename step 5 into place")
    job.cluster.nodes[1].link_down()
    (out1,) = job.outcomes(5, ranks=[1], timeout_s=30)
    job.fault(0, "")
    (out0,) = job.outcomes(5, ranks=[0], timeout_s=30)
    assert out0["outcome"] == "committed", out0
    assert out1["outcome"] == "committed", out1
    (warning,) = out1["warnings"]
    assert "did not answer" in warning and "the root holds iter_0000005 committed by attempt" in warning, warning
    job.cluster.nodes[1].link_up()
    _latest_everywhere(job, 5)
    job.save(6)
    job.committed(6)
    _latest_everywhere(job, 6)
    job.check(1)
    wait_until(lambda: _no_partial_saves(job), 15, "no partial save to remain")
    assert _steps_on_disk(job) == ["iter_0000001", "iter_0000003", "iter_0000004", "iter_0000005", "iter_0000006"]


@pytest.mark.timeout(120)
def test_partition_between_written_and_committed(make_job):
    job = make_job(2, CKPTD_COORDINATOR_TIMEOUT_S="6")  # link timeout 2 s, coordinator timeout 6 s
    job.save(1)
    job.committed(1)
    job.fault(0, "delay 1")  # node 0's own write is slow: node 1 has reported, the coordinator waits
    job.save(2)
    wait_until(
        lambda: any(s["written"] == [1] for s in job.coordinator_steps().values()),
        15,
        "node 1's WRITTEN of step 2 to reach the coordinator",
    )
    job.cluster.nodes[1].isolate()
    job.fault(0, "")
    wait_until(
        lambda: (job.root / "iter_0000002").is_dir() and not job.coordinator_steps(),
        15,
        "the coordinator to commit step 2 while node 1 is cut off",
    )
    # Silent longer than the link timeout: node 1's connection (and the verdict in it) was dropped.
    wait_until(
        lambda: (job.status(1) or {}).get("upstream", {}).get("silent_s", 0) > 2.3,
        10,
        "node 1 to miss the coordinator for longer than the link timeout",
    )
    job.cluster.nodes[1].rejoin()
    job.committed(2)  # node 1 resent its report and was answered with the verdict
    _latest_everywhere(job, 2)
    job.save(3)
    job.committed(3)


@pytest.mark.timeout(180)
def test_partition_isolates_the_coordinator_node(make_job):
    job = make_job(3)
    job.save(1)
    job.committed(1)
    job.cluster.nodes[0].isolate()
    for step in (2, 3, 4, 5):  # the other nodes keep saving: about 4 s each
        job.save(step)
        out = job.outcomes(step, timeout_s=30)
        assert out[0]["outcome"] == "aborted" and "ranks [1, 2] did not report" in out[0]["reason"], out
        for o in out[1:]:
            assert o["outcome"] == "aborted" and "did not answer" in o["reason"], out
        assert _steps_on_disk(job)[0] == "iter_0000001" and not (job.root / f"iter_{step:07d}").exists()
    job.check(1)
    job.cluster.nodes[0].rejoin()
    job.save(6)
    job.committed(6, timeout_s=30)  # within the 4 s commit timeout, or the coordinator aborts it
    _latest_everywhere(job, 6)
    wait_until(lambda: _no_partial_saves(job), 15, "the aborted steps' files to be removed")
    assert _steps_on_disk(job) == ["iter_0000001", "iter_0000006"]
