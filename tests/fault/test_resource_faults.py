"""Guarantee 4 with a real daemon and injected disk faults: a full disk (while writing a data file,
while committing, while replacing the tracker), permission denied, a read-only filesystem, a slow
disk. Each time the save fails with a clear error on its handle (or, on a slow disk, merely takes
longer while training goes on), the earlier checkpoints stay intact and loadable, nothing partial
stays behind, and the next save works, even of the very step that failed, once the cause is gone.

The faults come from the daemon's fault file (``CkptdConfig.debug_fault_file``, a test hook that
raises the real ``OSError`` from the daemon's file opener); tests/fault/test_real_resource_faults.py
causes the same failures for real where the machine allows.
"""

from __future__ import annotations

import re
import time

import pytest

import ckptd
from tests.fault.single_job import loads_bit_exact, single_job, state_dict, tmp_leftovers


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp, single_job(tmp_path_factory.mktemp("faults"), mp) as j:
        j.committed(1)
        yield j


def _intact(job, *steps: int) -> None:
    for step in steps:
        loads_bit_exact(job.ckpt, step)
    assert job.ckpt.latest() == max(steps)
    assert not tmp_leftovers(job.root)


@pytest.mark.timeout(60)
def test_disk_full_while_writing_a_data_file(job):
    job.fault("fail ENOSPC 4096 __*")  # the rank's data file hits a full disk after 4 KiB
    err = job.failed(2)
    assert "writing its data file failed" in err and "No space left on device" in err and "__0_0.distcp" in err
    _intact(job, 1)
    job.fault("")
    job.committed(2)  # the same step, once there is room again
    _intact(job, 1, 2)


@pytest.mark.timeout(60)
def test_disk_full_while_committing(job):
    job.fault("fail ENOSPC 0 .metadata*")  # the coordinator cannot write the DCP index
    err = job.failed(3)
    assert "commit failed" in err and "No space left on device" in err and ".metadata" in err
    _intact(job, 1, 2)
    # The checkpoint is complete and renamed, but the tracker cannot name it: not committed either.
    job.fault("fail ENOSPC 0 latest.tmp")  # atomic writes open <name>.tmp first
    err = job.failed(4)
    assert "commit failed" in err and "No space left on device" in err
    assert (job.root / "latest").read_text().strip() == "iter_0000002"
    _intact(job, 1, 2)
    # Megatron-LM's tracker is a convenience: failing it leaves the step committed.
    job.fault("fail ENOSPC 0 latest_checkpointed_iteration.txt")
    job.committed(5)
    job.fault("")
    job.committed(6)
    _intact(job, 1, 2, 5, 6)
    assert (job.root / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


@pytest.mark.timeout(60)
def test_permission_denied_and_read_only_filesystem(job):
    job.fault("fail EACCES")
    err = job.failed(7)
    assert "Permission denied" in err
    job.fault("fail EROFS")
    err = job.failed(8)
    assert "Read-only file system" in err
    _intact(job, 1, 2, 5, 6)
    job.fault("")
    job.committed(8)
    _intact(job, 1, 2, 5, 6, 8)


@pytest.mark.timeout(60)
def test_slow_disk_does_not_stall_training(job):
    delay_s = 2.0
    job.fault(f"delay {delay_s}")  # every file the daemon opens for writing takes that much more
    t0 = time.monotonic()
    h = job.ckpt.save(state_dict(9), step=9)
    # save() returned before the daemon could have opened one file: only the copy into shared memory
    assert time.monotonic() - t0 < delay_s and h.stall_s < delay_s
    with pytest.raises(ckptd.SaveTimeoutError, match="may still commit later"):
        h.wait(timeout_s=0.2)
    assert not h.done() and job.ckpt.latest() == 8
    h2 = job.ckpt.save(state_dict(10), step=10)  # a second slot: training is not blocked either
    assert h2.stall_s < delay_s
    job.fault("")
    assert h.wait(timeout_s=30) and h2.wait(timeout_s=30)
    _intact(job, 1, 2, 5, 6, 8, 9, 10)


@pytest.mark.timeout(60)
def test_a_storage_error_of_the_commit_names_its_file(job):
    """A write that fails mid-file names no file (write(2) does not; the fault hook raises it
    so): the commit's error still names the file it was writing, not the root."""
    for step, rules, name in (
        (11, "fail ENOSPC 1 common.pt*", "common.pt.tmp"),
        (12, "fail EIO 64 .metadata*", ".metadata.tmp"),
    ):
        job.fault(rules)
        err = job.failed(step)
        where = rf"{re.escape(str(job.root))}/iter_{step:07d}\.[0-9a-f]{{12}}-\d+\.tmp/{re.escape(name)}: "
        assert re.search(where, err) and "commit failed" in err, err
    job.fault("")
    job.committed(11)
    _intact(job, 1, 2, 5, 6, 8, 9, 10, 11)
