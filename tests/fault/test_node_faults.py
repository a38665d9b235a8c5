"""Guarantee 4 across nodes: 2 simulated nodes x 1 rank, real daemons, real ZeroMQ, real files.

- a slow disk on one node (its daemon's fault file says ``delay``) beyond the commit timeout: the
  save aborts on every rank with a reason that names the rank and the timeout; the late write is
  discarded; the next save commits once the disk is fast again;
- an unreachable coordinator (node 0's daemon is stopped, so node 1's daemon points nowhere): the
  save of node 1 fails on its handle within the coordinator timeout, saying so; once node 0 comes
  back (its rank's next save restarts it), saves commit again.
- node 1's daemon killed mid-save, or before it answered a SAVE: its rank's next save has the next
  daemon abort the lost step, so the step after it commits without waiting out the commit timeout.

Earlier checkpoints load bit-exact throughout.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd import ShardedTensor
from tools.harness.daemons import stop_daemons
from tools.harness.ports import free_port
from tools.harness.ranks import run_ranks
from tools.harness.waiting import wait_for_exit, wait_until

# long enough for a first save on a loaded machine (3 test workers on 2 cores) to report in time
COMMIT_TIMEOUT_S = 4.0
COORDINATOR_TIMEOUT_S = 2.0


def _env(runtime_dir: Path, commit_timeout_s: float) -> dict[str, str]:
    """Two nodes on this machine, quick to notice a silent coordinator."""
    return {
        "CKPTD_RUNTIME_DIR": str(runtime_dir),
        "CKPTD_COORDINATOR_PORT": str(free_port()),
        "CKPTD_HEARTBEAT_S": "0.1",
        "CKPTD_COMMIT_TIMEOUT_S": str(commit_timeout_s),
        "CKPTD_COORDINATOR_TIMEOUT_S": str(COORDINATOR_TIMEOUT_S),
        "CKPTD_IDLE_EXIT_S": "60",
    }


def as_node_rank(rank: int, env: dict[str, str], faults: str) -> Path:
    """This process is rank ``rank``, alone on node ``rank``, whose daemon reads its disk faults
    from the file returned (under ``faults``)."""
    os.environ.update(env)
    fault_file = Path(faults) / f"node{rank}"
    os.environ.update(
        LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), CKPTD_DEBUG_FAULT_FILE=str(fault_file)
    )
    return fault_file


def _sd(rank: int, step: int, w: torch.Tensor | None = None) -> dict:
    w = torch.full((4, 8), float(step * 10 + rank)) if w is None else w
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)), "iteration": step}


def _check(ckpt: ckptd.Checkpointer, rank: int, step: int) -> None:
    out = ckpt.load(_sd(rank, -1, torch.zeros(4, 8)), step=step)
    assert torch.equal(out["w"], torch.full((4, 8), float(step * 10 + rank))) and out["iteration"] == step


def _failure(h: ckptd.SaveHandle, timeout_s: float) -> str:
    with pytest.raises(ckptd.SaveFailedError) as err:
        h.wait(timeout_s=timeout_s)
    return str(err.value)


def _node_faults(rank: int, world: int, env: dict[str, str], root: str, faults: str) -> dict:
    fault_file = as_node_rank(rank, env, faults)
    out: dict = {}
    ckpt = ckptd.Checkpointer(root)
    try:
        ckpt.save(_sd(rank, 1), step=1).wait(timeout_s=60)

        # --- node 1's disk is slower than the commit timeout
        if rank == 1:
            fault_file.write_text(f"delay {2 * COMMIT_TIMEOUT_S}\n")
        dist.barrier()
        out["slow"] = _failure(ckpt.save(_sd(rank, 2), step=2), 30)
        assert ckpt.latest() == 1 and not (Path(root) / "iter_0000002").exists()
        dist.barrier()
        fault_file.unlink(missing_ok=True)
        if rank == 1:
            # The disk is fast again once the slow write in flight is done: a rank's saves persist
            # in order through its staging ring, so step 3 would queue behind it.
            wait_until(lambda: ckpt.status()["jobs_in_flight"] == 0, 30, "the slow write to finish")
        dist.barrier()
        ckpt.save(_sd(rank, 3), step=3).wait(timeout_s=60)
        _check(ckpt, rank, 1)

        # --- the coordinator is unreachable: node 0's daemon is gone, node 1's points nowhere
        log_path = ckpt.endpoints.log_path
        restarts_seen = log_path.read_text().count("coordinator restarted")
        dist.barrier()
        if rank == 0:
            pid = ckpt.status()["pid"]
            os.kill(pid, signal.SIGTERM)
            wait_for_exit(pid, 30, "node 0's daemon to exit")
        dist.barrier()
        if rank == 1:
            t0 = time.monotonic()
            out["unreachable"] = _failure(ckpt.save(_sd(rank, 4), step=4), 30)
            out["unreachable_s"] = time.monotonic() - t0
        # The cause goes away: rank 0's Checkpointer restarts node 0's daemon when it next talks
        # to it. Saves started after that commit.
        dist.barrier()
        if rank == 0:
            assert ckpt.status()["pid"] != pid
        # Node daemons learn a restarted coordinator at their next ping (every heartbeat); a report
        # sent before that is taken for one the old coordinator lost, and its step aborts. Node 1's
        # daemon logs when it learns it; node 0's is new and never knew the old one.
        if rank == 1:
            wait_until(
                lambda: log_path.read_text().count("coordinator restarted") > restarts_seen,
                30,
                "node 1's daemon to learn of the restarted coordinator",
            )
        dist.barrier()
        ckpt.save(_sd(rank, 5), step=5).wait(timeout_s=60)
        assert ckpt.latest() == 5
        for step in (1, 3, 5):
            _check(ckpt, rank, step)
        out["pid"] = ckpt.status()["pid"]
    finally:
        ckpt.close(wait=False)
    return out


@pytest.mark.timeout(180)
def test_slow_node_and_unreachable_coordinator(tmp_path, runtime_dir):
    root = tmp_path / "ckpts"
    env = _env(runtime_dir, COMMIT_TIMEOUT_S)
    out = run_ranks(_node_faults, 2, env, str(root), str(tmp_path), timeout_s=150)
    stop_daemons(runtime_dir.glob("*.pid"))  # no daemon changes the root while it is looked at
    # Whichever clock ends first: the coordinator's (from rank 0's report) or node 1's (from rank 1's
    # SAVE, which reports a write not finished by then; ckptd.daemon.intake).
    within = re.escape(f"within {COMMIT_TIMEOUT_S:g} s")
    slow = rf"ranks \[1\] did not report {within}|rank 1 \(node 1\): its data file \S+ was not written {within}"
    for o in out:
        assert re.search(slow, o["slow"]) and "too slow" in o["slow"], o["slow"]
    assert "did not answer" in out[1]["unreachable"] and env["CKPTD_COORDINATOR_PORT"] in out[1]["unreachable"]
    assert out[1]["unreachable_s"] < COORDINATOR_TIMEOUT_S + 3, out[1]
    # Aborted steps never became visible. (Node 1's iter_0000004.<attempt>.tmp may remain: the
    # coordinator that could have removed it was down; the next coordinator start or `ckptd gc`
    # removes it.)
    assert sorted(p.name for p in root.glob("iter_*") if not p.name.endswith(".tmp")) == [
        "iter_0000001",
        "iter_0000003",
        "iter_0000005",
    ]
    assert {p.name.split(".")[0] for p in root.glob("*.tmp")} <= {"iter_0000002", "iter_0000004"}
    assert not [p for p in root.rglob("*.part") if ".tmp" not in str(p.parent)]


# The commit timeout the test must not wait for: a later step committing sooner shows the abort.
DEAD_DAEMON_COMMIT_TIMEOUT_S = 60.0


def _step_3_commits_at_once(ckpt: ckptd.Checkpointer, rank: int, h2: ckptd.SaveHandle | None, out: dict) -> None:
    """Every rank saves step 3 after node 1's daemon died with step 2: rank 1's save has its next
    daemon abort step 2, so rank 0's handle of it (``h2``) fails saying why, and step 3 commits
    without waiting out the commit timeout (``out``: the abort's reason, the commit's time)."""
    t0 = time.monotonic()
    h3 = ckpt.save(_sd(rank, 3), step=3)
    if h2 is not None:
        out["aborted"] = _failure(h2, DEAD_DAEMON_COMMIT_TIMEOUT_S / 3)
    h3.wait(timeout_s=DEAD_DAEMON_COMMIT_TIMEOUT_S / 3)
    out["committed_s"] = time.monotonic() - t0
    assert ckpt.latest() == 3
    for step in (1, 3):
        _check(ckpt, rank, step)


def _dead_node_daemon(rank: int, world: int, env: dict[str, str], root: str, faults: str) -> dict:
    fault_file = as_node_rank(rank, env, faults)
    out: dict = {}
    ckpt = ckptd.Checkpointer(root)
    try:
        ckpt.save(_sd(rank, 1), step=1).wait(timeout_s=60)
        # --- node 1's daemon dies while it writes rank 1's save of step 2
        if rank == 1:
            fault_file.write_text("hang __*\n")
        dist.barrier()
        h2 = ckpt.save(_sd(rank, 2), step=2)
        if rank == 1:
            pid = ckpt.status()["pid"]
            log_path = ckpt.endpoints.log_path
            wait_until(lambda: "injected fault: the open of" in log_path.read_text(), 30, "the write to hang")
            os.kill(pid, signal.SIGKILL)
            wait_for_exit(pid, 30, "node 1's daemon to exit")
            fault_file.unlink()
            out["lost"] = _failure(h2, 30)  # the rank finds its daemon gone
        dist.barrier()
        # --- the next step: rank 1's save starts node 1's next daemon, which it asks to abort step 2
        _step_3_commits_at_once(ckpt, rank, h2 if rank == 0 else None, out)
    finally:
        ckpt.close(wait=False)
    return out


@pytest.mark.timeout(180)
def test_a_node_daemon_that_died_mid_save_holds_no_later_commit(tmp_path, runtime_dir):
    """Node 1's daemon is SIGKILLed while it writes rank 1's save of step 2. Rank 1's save fails
    locally (its daemon is gone), and nobody told the coordinator: step 2 stayed collecting until
    commit_timeout_s, and step 3, written by every rank, waited behind it (attempts commit in the
    order they began). Rank 1's next save asks its next daemon to abort step 2: step 3 commits at
    once, and rank 0's save of step 2 fails saying why."""
    root = tmp_path / "ckpts"
    env = _env(runtime_dir, DEAD_DAEMON_COMMIT_TIMEOUT_S)
    out = run_ranks(_dead_node_daemon, 2, env, str(root), str(tmp_path), timeout_s=150)
    stop_daemons(runtime_dir.glob("*.pid"))
    assert out[1]["lost"].startswith("step 2 was not confirmed: "), out[1]
    assert "node daemon of rank 1 died holding its save of step 2" in out[0]["aborted"], out[0]
    assert max(o["committed_s"] for o in out) < DEAD_DAEMON_COMMIT_TIMEOUT_S / 3
    assert sorted(p.name for p in root.glob("iter_*") if not p.name.endswith(".tmp")) == [
        "iter_0000001",
        "iter_0000003",
    ]


def _daemon_lost_before_ack(rank: int, world: int, env: dict[str, str], root: str, faults: str) -> dict:
    as_node_rank(rank, env, faults)
    out: dict = {}
    ckpt = ckptd.Checkpointer(root)
    try:
        ckpt.save(_sd(rank, 1), step=1).wait(timeout_s=60)
        dist.barrier()
        if rank == 1:
            # --- node 1's daemon never reads rank 1's SAVE of step 2: it dies with it unanswered
            pid = ckpt.status()["pid"]
            os.kill(pid, signal.SIGSTOP)
            killer = threading.Timer(2.0, os.kill, (pid, signal.SIGKILL))
            killer.start()
            with pytest.raises(ckptd.DaemonError) as err:
                ckpt.save(_sd(rank, 2), step=2)
            killer.join()
            out["lost"] = str(err.value)
            h2 = None
        else:
            h2 = ckpt.save(_sd(rank, 2), step=2)
        dist.barrier()
        # --- rank 1's next save asks node 1's next daemon to abort step 2, which it never handed off
        _step_3_commits_at_once(ckpt, rank, h2, out)
    finally:
        ckpt.close(wait=False)
    return out


@pytest.mark.timeout(180)
def test_a_node_daemon_that_died_before_answering_a_save_holds_no_later_commit(tmp_path, runtime_dir):
    """Node 1's daemon dies with rank 1's SAVE of step 2 unanswered: save() raises, and no handle
    remembers the attempt. Rank 0's save of step 2 waited out commit_timeout_s, and step 3 behind
    it; the attempt is now asked to be aborted by node 1's next daemon, as a held save's is."""
    root = tmp_path / "ckpts"
    env = _env(runtime_dir, DEAD_DAEMON_COMMIT_TIMEOUT_S)
    out = run_ranks(_daemon_lost_before_ack, 2, env, str(root), str(tmp_path), timeout_s=150)
    stop_daemons(runtime_dir.glob("*.pid"))
    assert "died" in out[1]["lost"], out[1]
    assert "node daemon of rank 1 died holding its save of step 2" in out[0]["aborted"], out[0]
    assert max(o["committed_s"] for o in out) < DEAD_DAEMON_COMMIT_TIMEOUT_S / 3
