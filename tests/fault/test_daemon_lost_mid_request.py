"""A node daemon that dies while a request other than a save's waits for its answer (here
``status()``; also a ring's or a layout's registration, a SKIP, a resume's ABANDON): the request
raises DaemonLostError and closes the link's socket. Before, nobody dropped that daemon's ring or
resolved its pending saves: the next save() connected to a new daemon, named the dead one's ring
in its SAVE and was refused, at every later save; the pending handle stayed PENDING (wait() timed
out, close() waited out its timeout), or failed as "not committed". Now the loss is the session's
wherever it was found: the saves fail as unconfirmed (the root looked at), the next save
registers a new ring with the new daemon.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

import ckptd
from ckptd.errors import DaemonLostError
from tests.fault.single_job import single_job, state_dict
from tools.harness.waiting import wait_for_exit, wait_until


def _lose_daemon_during_status(job) -> None:
    """Stop the job's daemon (the one this test started), SIGKILL it half a second into a
    ``status()`` that waits for its answer, and require that ``status()`` raises the loss."""
    pid = job.daemon_pid
    os.kill(pid, signal.SIGSTOP)
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(DaemonLostError, match=f"pid {pid}"):
            job.ckpt.status()
    finally:
        killer.join()
    wait_for_exit(pid, 30, f"daemon {pid} to exit")


def _pending_step_2(job) -> ckptd.SaveHandle:
    job.committed(1)
    job.fault("hang __*")  # the data file's write: step 2 stays pending
    h = job.ckpt.save(state_dict(2), step=2)
    wait_until(lambda: "injected fault: the open of" in job.daemon_log(), 30, "the daemon to hang in the write")
    return h


@pytest.mark.timeout(120)
def test_a_daemon_lost_by_status_fails_the_pending_save_and_the_next_save_commits(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch) as job:
        h = _pending_step_2(job)
        _lose_daemon_during_status(job)
        job.fault("")
        with pytest.raises(ckptd.SaveFailedError) as err:
            h.wait(timeout_s=10)
        reason = str(err.value)
        assert reason.startswith("step 2 was not confirmed: the node daemon (pid "), reason
        assert f"its checkpoint {job.root / 'iter_0000002'} is not in place now" in reason, reason
        assert job.ckpt._ring.current is None  # the dead daemon's ring is gone with it
        job.committed(3)  # through a new daemon, into a new ring
        job.committed(4)


@pytest.mark.timeout(120)
def test_a_daemon_lost_by_status_is_reported_by_close(tmp_path, monkeypatch):
    """close() right after the loss: the pending save fails as the loss fails it (raised, nobody
    saw it), not as one the Checkpointer was closed before."""
    with single_job(tmp_path, monkeypatch) as job:
        h = _pending_step_2(job)
        _lose_daemon_during_status(job)
        job.fault("")
        with pytest.raises(ckptd.SaveFailedError, match="step 2 was not confirmed: the node daemon"):
            job.ckpt.close(timeout_s=10)
        assert h.status is ckptd.SaveStatus.ABORTED and "is not in place now" in str(h.error), h.error
        with ckptd.Checkpointer(job.root, config=job.config) as again:  # a new daemon (clears the dead one's files)
            again.save(state_dict(3), step=3).wait(timeout_s=30)
