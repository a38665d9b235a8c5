"""The pid-file protocol of a node daemon: a live daemon holds an exclusive ``flock`` on its pid file.

``<runtime_dir>/<job>-n<node>.pid`` (:attr:`ckptd.control.endpoints.Endpoints.pid_path`):

- the daemon takes the lock with :class:`PidLock` before anything else and holds it for its whole
  life, with its pid written in the file; a second daemon of the same job and node cannot take it;
- anyone else asks :func:`daemon_alive`: a held lock means a live daemon, whatever the file says,
  so a crashed daemon's stale file (or a pid reused by another process) is never mistaken for one;
- :func:`daemon_pid` reads the pid written in the file (a hint for signals and messages only:
  liveness is the lock's).

The lock is released by the kernel when the daemon dies, however it dies. A daemon that exits
removes its pid file first, while still holding the lock; a starting daemon that opened that file
just before then checks, once it holds the lock, that the path still names the file it locked,
and takes the lock again on the file the path names if not.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from ..format.safefs import lock_by, still_named
from .endpoints import check_daemon_file


class PidLock:
    """An exclusive ``flock`` on the pid file, held for the daemon's lifetime."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self, retry_s: float = 1.0) -> bool:
        """Take the lock (retrying for ``retry_s``) and write this process's pid into the file;
        False when another process holds it."""
        deadline = time.monotonic() + retry_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                held = lock_by(fd, deadline)
                if held and still_named(fd, self.path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if not held:
                return False
            # The daemon that held it removed the file on release, after this one opened it: a
            # lock on that file is one nobody finds (no daemon_alive(), no `daemon stop`), while
            # the root's lock would refuse every other daemon of the job. Lock the file named now.
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        self.fd = fd
        return True

    def release(self) -> None:
        """Remove the pid file and release the lock (a no-op when not held)."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: nobody reuses a stale file
            os.close(self.fd)
            self.fd = None


def daemon_alive(pid_path: Path) -> bool:
    """True while a daemon holds the pid-file lock (a precise test: no stale pids).

    Raises DaemonError when the pid file, or the daemon's socket next to it (``<stem>.sock``), is
    a link or another user's (:func:`~ckptd.control.endpoints.check_daemon_file`): clients ask
    this before they talk to a daemon, and must never talk to someone else's.
    """
    check_daemon_file(pid_path)
    check_daemon_file(pid_path.with_suffix(".sock"))
    try:
        fd = os.open(pid_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing releases our probe lock
    return False


def daemon_pid(pid_path: Path) -> int | None:
    """The pid written in the pid file, or None (missing, a link, empty or not a number).

    The file may be stale: ask :func:`daemon_alive` whether a daemon holds it."""
    try:
        fd = os.open(pid_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # missing, or a link (never followed)
        return None
    try:
        return int(os.read(fd, 64).decode(errors="replace").strip() or "0") or None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
