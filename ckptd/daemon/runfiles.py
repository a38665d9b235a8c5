"""Keeping a running daemon findable: its runtime directory, token, pid file, socket and log.

New processes of the job (a restarted trainer, ``ckptd status``, ``ckptd daemon stop``) find the
daemon only through its files in the runtime directory (ckptd.control.endpoints). Those can vanish
under a running daemon: logind removes ``$XDG_RUNTIME_DIR`` at the user's last logout, a ``/tmp``
cleaner removes old files or all of ``/tmp/ckptd-<uid>``. The ranks connected to the daemon keep
working without them (their connection stays, and they judge the daemon by its process:
ckptd.client.link), but a new process would find no daemon and start another one, which the root's
lock refuses (ckptd.daemon.rootlock).

Every heartbeat, :meth:`RuntimeFiles.check` puts back what vanished, in the order a client reads
them:

1. the directory, made and checked as every process makes it (0700, this user's, not a link:
   :func:`~ckptd.control.endpoints.open_private_dir`), but only while its parent exists: a parent
   that went too (``$XDG_RUNTIME_DIR`` at logout, a job's scratch directory) is not this daemon's
   to make again (new processes no longer choose a missing ``$XDG_RUNTIME_DIR``:
   ckptd.control.rundir). That is logged, and the next heartbeat looks again;
2. the log, when the daemon logs into it (a detached daemon): its output goes on in a new file;
3. the token file, with this daemon's token (when the token came from the file);
4. the pid file, locked and naming this process; one that another process holds is left alone
   (logged), and then the socket is not touched;
5. the ranks' socket, bound again at its path (the connections made before stay).

A restored pid file's lock is held until :meth:`close`, which runs after the :class:`PidLock`'s
release (ckptd.daemon.main): the file is never unlocked while it names this daemon.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ..control.endpoints import Endpoints, create_token_file, open_private_dir, read_token_file
from ..control.pidfile import PidLock
from ..errors import CkptdError
from ..format.safefs import lock_by, still_named

log = logging.getLogger(__name__)

# A client's liveness probe holds the pid file's lock for microseconds (ckptd.control.pidfile).
_PROBE_WAIT_S = 0.05
_PROBE_POLL_S = 0.005

FileId = tuple[int, int]  # (st_dev, st_ino)


def _file_id(st: os.stat_result) -> FileId:
    return st.st_dev, st.st_ino


def _path_id(name: str, dir_fd: int | None = None) -> FileId | None:
    """The identity of the file ``name`` names now (a link itself, never its target); None when absent."""
    try:
        return _file_id(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        return None


class RuntimeFiles:
    """The daemon's files in its runtime directory, put back when they vanish (module docstring).

    ``lock``: the pid file's lock the daemon holds; ``token``: the job token when it came from the
    token file (None: ``CKPTD_JOB_TOKEN``, nothing to put back); ``configured``: the directory is
    ``CKPTD_RUNTIME_DIR`` (checked as such: ckptd.control.endpoints.open_private_dir).
    """

    def __init__(self, ep: Endpoints, lock: PidLock, token: bytes | None, *, configured: bool) -> None:
        self.ep = ep
        self.configured = configured
        self.lock = lock
        self.token = token
        self.restored_fd: int | None = None  # the pid file this daemon made again, locked
        self.rebind: Callable[[], None] | None = None
        self.socket_id: FileId | None = None
        self.log_id = self._logging_into(ep.log_path)
        self.token_id: FileId | None = None
        self.problem: str | None = None  # what stops a restore now (logged once per change)

    @staticmethod
    def _logging_into(path: Path) -> FileId | None:
        """The log file's identity when this process's stderr is that file (a detached daemon)."""
        try:
            err = _file_id(os.fstat(2))
        except OSError:
            return None
        return err if _path_id(str(path)) == err else None

    def watch_socket(self, rebind: Callable[[], None]) -> None:
        """The ranks' socket is bound: watch it, and call ``rebind`` to bind it again."""
        self.rebind = rebind
        self.socket_id = _path_id(str(self.ep.socket_path))

    # --- the heartbeat's check ----------------------------------------------------------------
    def check(self) -> None:
        """Put back whatever of the daemon's files vanished (see the module docstring)."""
        dir_fd = self._open_dir()
        if dir_fd is None:
            return
        try:
            self._check_log(dir_fd)  # first: the log tells of the others
            self._check_token(dir_fd)
            if not self._check_pid_file(dir_fd):
                return
            self._check_socket()
        finally:
            os.close(dir_fd)
        if self.problem is not None:
            log.info("the runtime directory %s is whole again", self.ep.runtime_dir)
            self.problem = None

    def _trouble(self, what: str) -> None:
        if what != self.problem:
            log.warning(
                "%s; the ranks connected to this daemon go on saving, but new processes of the job "
                "(a restarted trainer, ckptd status, ckptd daemon stop) do not find it",
                what,
            )
            self.problem = what

    def _open_dir(self) -> int | None:
        path = self.ep.runtime_dir
        existed = os.path.lexists(path)
        try:
            fd = open_private_dir(path, parents=False, configured=self.configured)
        except FileNotFoundError:
            self._trouble(
                f"the runtime directory {path} was removed with its parent {path.parent}, which "
                "this daemon does not make again (not its own); it restores its files once the "
                "parent is back"
            )
            return None
        except (CkptdError, OSError) as exc:
            self._trouble(f"the runtime directory {path} cannot be restored: {exc}")
            return None
        if not existed:
            log.warning("the runtime directory %s was removed under this daemon; made it again (0700)", path)
        return fd

    def _check_token(self, dir_fd: int) -> None:
        if self.token is None:
            return
        path = self.ep.token_path
        now = _path_id(path.name, dir_fd)
        if now is not None and now == self.token_id:
            return
        if now is None and create_token_file(dir_fd, path, self.token) is not None:
            log.warning("the job token file %s was removed; wrote it again with this daemon's token", path)
        self.token_id = _path_id(path.name, dir_fd)  # checked once per file, not every heartbeat
        try:
            found = read_token_file(dir_fd, path)
        except (CkptdError, OSError) as exc:
            log.warning("the job token file %s cannot be checked: %s", path, exc)
            return
        if found != self.token:
            log.warning(
                "the job token file %s holds another token than this daemon's (made while it was "
                "gone): new processes of the job cannot talk to this daemon. Stop it (kill %d) once "
                "its saves committed, and start the job again",
                path,
                os.getpid(),
            )

    def _check_pid_file(self, dir_fd: int) -> bool:
        """Whether the pid file is this daemon's (put back if it vanished)."""
        name = self.ep.pid_path.name
        now = _path_id(name, dir_fd)
        held = {_file_id(os.fstat(fd)) for fd in (self.lock.fd, self.restored_fd) if fd is not None}
        if now is not None and now in held:
            return True
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            self._trouble(f"the pid file {self.ep.pid_path} cannot be made again: {exc}")
            return False
        try:
            if not self._lock(fd):
                self._trouble(
                    f"another process holds the pid file {self.ep.pid_path} that this daemon's was "
                    "replaced with (another daemon of this job and node?)"
                )
                os.close(fd)
                return False
            if not still_named(fd, name, dir_fd):  # replaced before we locked it: next time
                os.close(fd)
                return False
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except BaseException:
            os.close(fd)
            raise
        if self.restored_fd is not None:  # an earlier restored file, removed again
            os.close(self.restored_fd)
        self.restored_fd = fd
        log.warning(
            "the pid file %s was removed or replaced under this daemon; it names this one again", self.ep.pid_path
        )
        return True

    @staticmethod
    def _lock(fd: int) -> bool:
        try:
            return lock_by(fd, time.monotonic() + _PROBE_WAIT_S, _PROBE_POLL_S)
        except OSError:
            return False

    def _check_socket(self) -> None:
        if self.rebind is None:
            return
        path = self.ep.socket_path
        if _path_id(str(path)) == self.socket_id:
            return
        # Missing, or a stale file: no other daemon binds here while this one holds the pid file.
        self.rebind()
        self.socket_id = _path_id(str(path))
        log.warning("the ranks' socket %s was removed under this daemon; bound it again", path)

    def _check_log(self, dir_fd: int) -> None:
        if self.log_id is None:
            return
        path = self.ep.log_path
        if _path_id(path.name, dir_fd) == self.log_id:
            return
        try:
            fd = os.open(
                path.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
            )
        except OSError as exc:  # a link planted there, say: the log stays where it is, unreadable
            log.warning("the log file %s was removed and cannot be made again (%s); not trying again", path, exc)
            self.log_id = None
            return
        try:
            for stream in (1, 2):
                os.dup2(fd, stream)
        finally:
            os.close(fd)
        self.log_id = _file_id(os.fstat(2))
        log.warning("the log file %s was removed under this daemon; the log goes on here", path)

    def close(self) -> None:
        """After the PidLock's release: remove a restored pid file (still locked: nobody took it
        over) and let its lock go."""
        if self.restored_fd is None:
            return
        try:
            if still_named(self.restored_fd, self.ep.pid_path):
                self.ep.pid_path.unlink(missing_ok=True)
        finally:
            os.close(self.restored_fd)
            self.restored_fd = None
