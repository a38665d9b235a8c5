"""The pid-file lock of a node daemon (ckptd.control.pidfile), two holders in one process: a
flock is per open file, so two PidLocks of one path exclude each other as two daemons do."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ckptd.control.pidfile import PidLock, daemon_alive, daemon_pid


def _descriptors_of(path: Path) -> int:
    """How many descriptors of this process have ``path`` open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            continue
    return count


def test_a_daemon_that_waited_for_the_pid_lock_holds_the_file_its_path_names(tmp_path):
    """Daemon B opened the pid file while daemon A held it and waited for the lock; A removed the
    file and let go; B took the lock on the removed file and served invisibly: no pid file, so
    no daemon_alive(), `ckptd daemon stop` found none, and every daemon a Checkpointer started
    was refused by the root lock B held."""
    path = tmp_path / "job-n0.pid"
    first = PidLock(path)
    assert first.acquire()
    second = PidLock(path)
    took: list[bool] = []
    waiter = threading.Thread(target=lambda: took.append(second.acquire(retry_s=30.0)))
    waiter.start()
    try:
        deadline = time.monotonic() + 30.0
        while _descriptors_of(path) < 2:  # the waiter has opened the file first holds
            assert time.monotonic() < deadline, "the second PidLock never opened the pid file"
            time.sleep(0.001)
        first.release()
        waiter.join(60.0)
        assert took == [True]
        assert second.fd is not None
        held, named = os.fstat(second.fd), os.stat(path)
        assert (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)
        assert daemon_alive(path) and daemon_pid(path) == os.getpid()
    finally:
        waiter.join(60.0)
        second.release()
        first.release()
    assert not path.exists() and not daemon_alive(path)
