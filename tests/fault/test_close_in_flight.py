"""close(wait=False), or a close() that timed out, with a save in flight: the daemon took the save
and commits it after the Checkpointer is gone. Its handle used to be marked ABORTED, "step N was
not committed: the Checkpointer was closed before the step committed", and close(wait=False)
raised that as a failed save, while the step committed. Now the handle resolves unconfirmed,
saying the daemon still commits it and how to find out; close() raises no failure of it.
"""

from __future__ import annotations

import time

import pytest

import ckptd
from ckptd.format.rootlayout import step_dir_name
from tests.fault.single_job import loads_bit_exact, single_job, state_dict
from tools.harness.waiting import wait_until


def _in_flight(job, step: int) -> ckptd.SaveHandle:
    """Save ``step`` while the daemon's data file write hangs (the fault file's ``hang`` rule)."""
    job.fault("hang __*")
    h = job.ckpt.save(state_dict(step), step=step)
    wait_until(lambda: "injected fault: the open of" in job.daemon_log(), 30, "the daemon to hang in the write")
    return h


def _unconfirmed_then_committed(job, h: ckptd.SaveHandle) -> None:
    """``h`` resolved unconfirmed, saying how to learn the outcome; the step commits once the
    disk answers again, and loads bit-exact."""
    assert h.status is ckptd.SaveStatus.ABORTED and h.done()
    reason = str(h.error)
    assert reason.startswith(f"step {h.step} was not confirmed: the Checkpointer was closed before"), reason
    assert "still commits it" in reason and "ckptd ls" in reason and str(h.path) in reason, reason
    with pytest.raises(ckptd.SaveFailedError, match="was not confirmed"):
        h.wait(timeout_s=1)
    job.fault("")
    wait_until(lambda: job.ckpt.latest() == h.step, 30, f"step {h.step} to commit")
    assert h.path == job.root / step_dir_name(h.step)
    loads_bit_exact(job.ckpt, h.step)


@pytest.mark.timeout(120)
def test_close_without_waiting_leaves_a_save_in_flight_to_commit(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        h = _in_flight(job, 2)
        try:
            job.ckpt.close(wait=False)  # raises nothing: the save did not fail
            _unconfirmed_then_committed(job, h)
        finally:
            job.fault("")  # a hung write would keep the daemon from stopping


@pytest.mark.timeout(120)
def test_a_close_that_timed_out_leaves_a_save_in_flight_to_commit(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        h = _in_flight(job, 2)
        try:
            t0 = time.monotonic()
            with pytest.raises(ckptd.SaveTimeoutError, match="step 2 did not commit within the wait timeout"):
                job.ckpt.close(timeout_s=1.0)
            assert time.monotonic() - t0 < 10
            _unconfirmed_then_committed(job, h)
        finally:
            job.fault("")  # a hung write would keep the daemon from stopping
