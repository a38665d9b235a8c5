"""What a rank says when its node daemon, the coordinator too, dies with a save pending (issue 25):
the truth. SIGKILLed right after the commit's rename (the tracker write hangs, by the fault file's
``hang`` rule), the step is complete and the next daemon makes it latest: the reason says so
(it used to say "died before step 2 committed"). Killed while the data file is still being
written, the checkpoint is not in place and the reason says that instead.
"""

from __future__ import annotations

import os
import signal

import pytest

import ckptd
from tests.fault.single_job import loads_bit_exact, single_job, state_dict
from tools.harness.waiting import wait_for_exit, wait_until


def _kill_daemon_when(job, what: str) -> None:
    pid = job.daemon_pid
    wait_until(lambda: what in job.daemon_log(), 30, f"the daemon to log {what!r}")
    os.kill(pid, signal.SIGKILL)
    wait_for_exit(pid, 30, f"daemon {pid} to exit")
    job.fault("")


@pytest.mark.timeout(120)
def test_a_daemon_killed_after_the_rename_says_the_step_is_complete(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        job.fault("hang latest.tmp")  # the tracker's write: after the checkpoint was renamed
        h = job.ckpt.save(state_dict(2), step=2)
        _kill_daemon_when(job, "injected fault: the open of")
        with pytest.raises(ckptd.SaveFailedError) as err:
            h.wait(timeout_s=30)
        reason = str(err.value)
        assert f"its checkpoint {job.root / 'iter_0000002'} is complete" in reason, reason
        assert "Checkpointer.latest() tells" in reason and "not committed" not in reason
        job.committed(3)  # the next daemon finished the interrupted commit first
        assert "the tracker now names iter_0000002" in job.daemon_log()
        loads_bit_exact(job.ckpt, 2)
        assert job.ckpt.latest() == 3


@pytest.mark.timeout(120)
def test_a_daemon_killed_mid_write_says_the_checkpoint_is_not_in_place(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        job.fault("hang __*")  # the data file's write
        h = job.ckpt.save(state_dict(2), step=2)
        _kill_daemon_when(job, "injected fault: the open of")
        with pytest.raises(ckptd.SaveFailedError) as err:
            h.wait(timeout_s=30)
        reason = str(err.value)
        assert f"its checkpoint {job.root / 'iter_0000002'} is not in place now" in reason, reason
        assert reason.startswith("step 2 was not confirmed: ")
        assert job.ckpt.latest() == 1
        job.committed(2)


def test_a_step_committed_by_another_attempt_is_not_called_this_saves(tmp_path):
    """After a rollback, ``iter_2`` of the abandoned branch is complete, but its commit record
    names another attempt: a re-save of step 2 whose daemon died is not in place (it used to be
    called complete, to be made latest by the next daemon)."""
    from ckptd.client.pending import daemon_lost_reason
    from tests.checkpoints import make_root, stamp_commits

    root = make_root(tmp_path / "r", [1, 2], latest=2)
    stamp_commits(root, [1, 2])  # attempt 0123456789ab-1
    path = root / "iter_0000002"
    assert "is complete" in daemon_lost_reason("died", 2, path, "0123456789ab-1")
    assert "is not in place now" in daemon_lost_reason("died", 2, path, "fedcba987654-1")
    # The same attempt id on an abandoned branch (a repeated CKPTD_RUN_ID): 1 was committed after 2.
    stamp_commits(root, [2, 1])
    (root / "latest").write_text("iter_0000001\n")
    assert "is not in place now" in daemon_lost_reason("died", 2, path, "0123456789ab-1")


def test_a_step_the_rank_cannot_look_at_is_said_unknown_without_asking_the_store(tmp_path, monkeypatch):
    """Losing the daemon fails every pending save inside save() or done(): an ``s3://`` step is not
    looked at (a GET per pending save, each up to the store's request timeout, used to run there),
    and a directory the rank cannot read (ESTALE on NFS) no longer raises out of the loop, which
    left the later saves pending and the ring not quiesced."""
    import errno

    from ckptd.client import pending
    from ckptd.storage.url import parse_location

    monkeypatch.setattr(pending, "read_commit_record", None)  # any look at a store or root would fail
    reason = pending.daemon_lost_reason("died", 2, parse_location("s3://bucket/run/iter_0000002"), "0123456789ab-1")
    assert "whether its checkpoint s3://bucket/run/iter_0000002 committed is not known here" in reason, reason

    def stale(path):
        raise OSError(errno.ESTALE, "Stale file handle", str(path))

    monkeypatch.setattr(pending, "is_real_dir", stale)
    reason = pending.daemon_lost_reason("died", 2, tmp_path / "iter_0000002", "0123456789ab-1")
    assert "committed is not known here" in reason, reason


@pytest.mark.timeout(120)
def test_the_ring_of_a_lost_daemon_is_dropped_even_when_stopping_its_producers_fails(tmp_path, monkeypatch):
    """Losing the daemon fails the pending saves, stops the ring's producers and drops the ring. A
    producer that would not stop (quiesce raising) left the dead daemon's ring in place, and every
    later SAVE to the next daemon was refused for naming a ring it does not know."""
    from ckptd.client.rankring import RankRing
    from ckptd.errors import StagingError

    quiesce = RankRing.quiesce

    def failing(self, *args, **kwargs):
        if kwargs.get("daemon_gone"):
            raise StagingError("the lazy copier did not stop (injected)")
        return quiesce(self, *args, **kwargs)

    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        monkeypatch.setattr(RankRing, "quiesce", failing)
        job.fault("hang __*")
        h = job.ckpt.save(state_dict(2), step=2)
        _kill_daemon_when(job, "injected fault: the open of")
        with pytest.raises(StagingError, match="injected"):
            h.wait(timeout_s=30)
        monkeypatch.setattr(RankRing, "quiesce", quiesce)
        with pytest.raises(ckptd.SaveFailedError, match="not in place now"):
            h.wait(timeout_s=30)
        assert job.ckpt._ring.current is None
        job.committed(3)
        loads_bit_exact(job.ckpt, 3)
