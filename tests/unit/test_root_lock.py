"""The node lock of a checkpoint root (ckptd.daemon.rootlock), in this process: no daemon."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from ckptd.daemon.rootlock import RootBusyError, RootLock, _still_named
from ckptd.staging.segment import SHM_DIR
from ckptd.storage.url import S3Location


def test_the_machine_lock_of_an_s3_root_is_removed_when_its_daemon_lets_go(tmp_path):
    """One file per job and node in /dev/shm: left behind, they piled up (317 on a test machine)."""
    job = secrets.token_hex(6)
    first = RootLock(S3Location(bucket="b", prefix="run"), 0, job)
    first.acquire(runtime_dir=tmp_path, job=job)
    path = SHM_DIR / first.name
    assert path.exists()
    with pytest.raises(RootBusyError, match="another ckptd daemon"):
        RootLock(S3Location(bucket="b", prefix="run"), 0, job).acquire(runtime_dir=tmp_path, job=job)
    first.release()
    assert not path.exists()
    second = RootLock(S3Location(bucket="b", prefix="run"), 0, job)
    second.acquire(runtime_dir=tmp_path, job=job)  # a relaunch locks a new file
    assert path.exists()
    second.release()
    assert not path.exists()


def test_two_jobs_on_one_s3_root_and_machine_meet_at_its_lock_whatever_their_job_ids(tmp_path):
    """The machine lock of an s3:// root was named by the job id: a second job with another id
    started, removed the first one's saves in flight as a crash's leftovers, and each job's
    retention retired the other's checkpoints."""
    prefix = f"run-{secrets.token_hex(4)}"
    first = RootLock(S3Location(bucket="b", prefix=prefix), 0, "job-a")
    first.acquire(runtime_dir=tmp_path, job="job-a")
    try:
        with pytest.raises(RootBusyError, match="another ckptd daemon"):
            RootLock(S3Location(bucket="b", prefix=prefix), 0, "job-b").acquire(runtime_dir=tmp_path, job="job-b")
        other = RootLock(S3Location(bucket="b", prefix=prefix + "-other"), 0, "job-b")  # another root: free
        other.acquire(runtime_dir=tmp_path, job="job-b")
        other.release()
    finally:
        first.release()


def test_the_lock_file_of_a_posix_root_stays(tmp_path):
    lock = RootLock(tmp_path, 0, "job")
    lock.acquire(runtime_dir=tmp_path, job="job")
    lock.release()
    assert (tmp_path / lock.name).is_file()


def test_a_lock_taken_on_a_file_removed_meanwhile_is_told_apart(tmp_path: Path):
    """What a daemon that opened the lock file just before its holder removed it checks once it
    holds the lock: the name leads to another file, or to none."""
    (tmp_path / "l").write_bytes(b"")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fd = os.open(tmp_path / "l", os.O_RDONLY)
    try:
        assert _still_named(fd, "l", dir_fd)
        os.unlink(tmp_path / "l")
        assert not _still_named(fd, "l", dir_fd)
        (tmp_path / "l").write_bytes(b"")
        assert not _still_named(fd, "l", dir_fd)
    finally:
        os.close(fd)
        os.close(dir_fd)


def test_a_lock_file_that_cannot_be_opened_is_a_clear_error(tmp_path):
    """A lock file the daemon cannot open (here a link planted at its name; another user's file, or
    a read-only root, alike) failed the daemon with a bare OSError naming the file relative to the
    root."""
    from ckptd.errors import StorageError

    lock = RootLock(tmp_path, 0, "job")
    (tmp_path / lock.name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StorageError, match=rf"cannot open the lock file {tmp_path / lock.name} of .*write access"):
        lock.acquire(runtime_dir=tmp_path, job="job")


@pytest.mark.timeout(30)
def test_a_fifo_at_the_lock_name_is_refused_not_waited_on(tmp_path):
    """A FIFO planted at the lock's name blocked the daemon's open for good (its pid lock held,
    later starts exited as busy, the ranks saw only a start timeout)."""
    from ckptd.errors import StorageError

    lock = RootLock(tmp_path, 0, "job")
    os.mkfifo(tmp_path / lock.name)
    with pytest.raises(StorageError, match=rf"lock file {tmp_path / lock.name} of .* is not a regular file"):
        lock.acquire(runtime_dir=tmp_path, job="job")
