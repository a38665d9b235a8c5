"""Guarantee 4 with a disk that hangs before any write of a step completes (issue 25): the step
aborts within ``commit_timeout_s`` (plus the daemon's tick), while the write still hangs, with a
reason naming the file; once the disk answers again the late write's files are removed and the
same step saves and commits. Before, the coordinator learnt of a step only from a finished write,
so such a step never aborted: ``wait()`` timed out for as long as the disk hung.

The hang is the fault file's ``hang`` rule (ckptd.daemon.faults): the daemon's open of the data
file blocks until the test removes the rule.
"""

from __future__ import annotations

import pytest

import ckptd
from ckptd.format.rootlayout import step_dir_name
from tests.fault.single_job import single_job, state_dict, tmp_leftovers
from tools.harness.waiting import wait_until

COMMIT_TIMEOUT_S = 2.0
MARGIN_S = 15.0  # the tick (0.1 s here) and the messages, on a loaded 2-core machine


@pytest.mark.timeout(120)
def test_a_hung_disk_aborts_the_step_within_commit_timeout(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch, commit_timeout_s=COMMIT_TIMEOUT_S) as job:
        job.committed(1)
        job.fault("hang __*")  # every data file's open hangs
        try:
            first = job.ckpt.save(state_dict(2), step=2)
            second = job.ckpt.save(state_dict(3), step=3)  # queued behind the hung write
            for h in (first, second):
                with pytest.raises(ckptd.SaveFailedError, match=r"was not written within 2 s of its SAVE") as err:
                    h.wait(timeout_s=COMMIT_TIMEOUT_S + MARGIN_S)
                assert h.status is ckptd.SaveStatus.ABORTED and "CKPTD_COMMIT_TIMEOUT_S" in str(err.value)
            assert "__0_0.distcp" in str(err.value) and f"iter_{3:07d}." in str(err.value)
            # Decided while the disk still hangs: the hang was never released, nothing was written.
            log = job.daemon_log()
            assert "injected fault: the open of" in log and "injected fault: the hang of" not in log
            assert job.ckpt.latest() == 1
        finally:
            job.fault("")  # the disk answers again: the late writes end and their files are removed
        wait_until(lambda: not tmp_leftovers(job.root), 30, "the late writes' files to be removed")
        assert not (job.root / step_dir_name(2)).exists()
        job.committed(2)
        job.committed(3)
        assert job.ckpt.latest() == 3
