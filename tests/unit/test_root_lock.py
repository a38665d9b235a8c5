"""The node lock of a checkpoint root (ckptd.daemon.rootlock), in this process: no daemon."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import secrets
import stat
from pathlib import Path

import pytest

from ckptd.daemon.rootlock import RootBusyError, RootLock, recorded_holders
from ckptd.errors import DaemonError
from ckptd.format.safefs import still_named
from ckptd.staging.segment import SHM_DIR
from ckptd.storage.url import S3Location

OTHER_UID = 65534  # another local user (the tests run as root: chown stands for their files)


def test_the_machine_lock_of_an_s3_root_is_removed_when_its_daemon_lets_go(tmp_path):
    """One file per job and node in /dev/shm: left behind, they piled up (317 on a test machine)."""
    job = secrets.token_hex(6)
    first = RootLock(S3Location(bucket="b", prefix="run"), 0, job)
    first.acquire(runtime_dir=tmp_path, job=job)
    path = first.root / first.name
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
        assert still_named(fd, "l", dir_fd)
        os.unlink(tmp_path / "l")
        assert not still_named(fd, "l", dir_fd)
        (tmp_path / "l").write_bytes(b"")
        assert not still_named(fd, "l", dir_fd)
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


def _plant_held_lock(path: Path) -> int:
    """What another user can leave at a lock's name: their file, a fake holder, their flock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, json.dumps({"pid": 1, "host": "elsewhere", "runtime_dir": "/nonexistent"}).encode())
    os.fchown(fd, OTHER_UID, OTHER_UID)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_another_user_cannot_plant_the_machine_lock_of_an_s3_root(tmp_path):
    """The lock of an s3:// root was /dev/shm/.ckptd-s3-<digest of the URL>-n<node>.lock, a name
    anyone could compute from a daemon's command line: another user who created it first (held,
    or unreadable) kept every daemon of the root from starting, and the sticky /dev/shm kept its
    victim from removing it. The lock now lies in a directory of the user's own."""
    root = S3Location(bucket="b", prefix=f"run-{secrets.token_hex(4)}")
    digest = hashlib.sha256(str(root).encode()).hexdigest()[:20]
    planted = SHM_DIR / f".ckptd-s3-{digest}-n0.lock"
    fd = _plant_held_lock(planted)
    lock = RootLock(root, 0, "job")
    try:
        lock.acquire(runtime_dir=tmp_path, job="job")
        lock_dir = lock.root
        assert lock_dir.parent == SHM_DIR and lock_dir.name.startswith(f".ckptd-{os.getuid()}")
        st = os.lstat(lock_dir)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert (lock_dir / lock.name).is_file()
    finally:
        lock.release()
        os.close(fd)
        planted.unlink()


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A private directory standing for /dev/shm (world-writable, sticky)."""
    base = tmp_path / "shm"
    base.mkdir()
    base.chmod(0o1777)
    return base


def test_a_lock_directory_another_user_took_is_passed_over_for_one_of_ours(tmp_path, shm):
    """Another user who creates /dev/shm/.ckptd-<uid> first (and holds a lock in it) stops nothing:
    the user's daemons meet in a fallback directory of the user's own, as the runtime directory's
    fallback is found (ckptd.control.rundir)."""
    root = S3Location(bucket="b", prefix="run")
    squatted = shm / f".ckptd-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, OTHER_UID, OTHER_UID)
    first = RootLock(root, 0, "job-a", shm=shm)
    fd = _plant_held_lock(squatted / first.name)
    try:
        first.acquire(runtime_dir=tmp_path, job="job-a")
        mine = first.root
        assert mine.parent == shm and mine.name.startswith(f"{squatted.name}-")
        st = os.lstat(mine)
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
        # A second job of this user meets the first one there, and the holder is found there.
        with pytest.raises(RootBusyError, match="another ckptd daemon"):
            RootLock(root, 0, "job-b", shm=shm).acquire(runtime_dir=tmp_path, job="job-b")
        assert recorded_holders(root, shm)[0]["job"] == "job-a"
    finally:
        first.release()
        os.close(fd)


@pytest.mark.parametrize("mode", [0o777, 0o755], ids=["0o777", "0o755"])
def test_a_lock_directory_open_to_others_is_refused_saying_what_to_do(tmp_path, shm, mode):
    """A lock directory of this user that others may have put files in (a lock of theirs, held)
    is refused, not used: naming it, its mode, and what to do."""
    lock_dir = shm / f".ckptd-{os.getuid()}"
    lock_dir.mkdir()
    lock_dir.chmod(mode)
    lock = RootLock(S3Location(bucket="b", prefix="run"), 0, "job", shm=shm)
    with pytest.raises(
        DaemonError, match=rf"{lock_dir} has mode {mode:#o}, not 0700.*chmod 700 {lock_dir}.*or remove it"
    ):
        lock.acquire(runtime_dir=tmp_path, job="job")
    assert not lock.acquired and lock.fd is None
    lock_dir.chmod(0o700)
    lock.acquire(runtime_dir=tmp_path, job="job")
    lock.release()
