"""One job per checkpoint root: each node daemon holds a lock in the root for its whole life.

Two jobs saving into one root (the same job launched twice, with its own runtime directory and
token) would destroy each other: a starting daemon removes its job's shared-memory segments and
uncommitted ``.tmp`` saves as a crash's leftovers (the other job's live rings and saves in flight),
each job's retention deletes the other's checkpoints, and a restart resumes from the other job's
checkpoint. So before touching anything a daemon takes an exclusive ``flock`` on
``<root>/.ckptd-n<node>.lock`` (its node's; node 0's is the coordinator's) and writes who it is
into it; a second job's daemon finds it held and refuses to start with :class:`RootBusyError`,
naming the holder. The kernel releases the lock when its daemon dies, however it dies, so a crashed
job never blocks its own restart; a daemon that outlives its trainer (it persists their last saves)
is the same job's, and a relaunch with the same runtime directory connects to it.

On NFS, ``flock`` is emulated with POSIX locks and held across machines (NFSv4, or v3 with lockd);
where the filesystem cannot lock at all, the daemon logs that a second job is not detected and
goes on. Object storage has no locks: for an ``s3://`` root the lock is a file of the machine
and user, ``.ckptd-s3-<digest of the URL>-n<node>.lock``, which keeps a second job of the user on
the same machine from removing the first one's rings and saves, whatever job id each has; two jobs
on one ``s3://`` root on different machines, or of different users, are not detected. It lies in
the user's own ``/dev/shm/.ckptd-<uid>`` (0700, or refused), found as the default runtime directory
is (:func:`ckptd.control.rundir.private_dir_in`: where another user took that name first, a
``/dev/shm/.ckptd-<uid>-<random>`` of the user's). In ``/dev/shm`` itself anyone could create the
lock first (the URL is on every daemon's command line) and hold it, or make it unreadable: no
daemon of the root would start, and the sticky ``/dev/shm`` kept its victim from removing it. That
file is one per root and node, so its daemon removes it when it exits (while still holding the
lock; a daemon that locked the removed file meanwhile sees that the name no longer leads to it,
and takes the lock again on the new one); the file in a POSIX root stays.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

from ..control.endpoints import open_private_dir
from ..control.rundir import find_private_dir, private_dir_in
from ..errors import DaemonError, StorageError
from ..format.rootlayout import LOCK_PREFIX, LOCK_SUFFIX, node_lock_name
from ..format.safefs import still_named
from ..staging.segment import SHM_DIR
from ..storage.url import Location, S3Location

log = logging.getLogger(__name__)

_HOLDER_MAX_NBYTES = 4096


class RootBusyError(DaemonError):
    """Another job's daemon holds this node's lock in the checkpoint root."""


def _s3_lock_stem(root: S3Location) -> str:
    # Named by the root, not the job: two jobs on one root and machine must meet here.
    return f".ckptd-s3-{hashlib.sha256(str(root).encode()).hexdigest()[:20]}-n"


def _s3_lock_dir_name() -> str:
    return f".ckptd-{os.getuid()}"


def open_s3_lock_dir(shm: Path = SHM_DIR) -> tuple[int, Path]:
    """``(fd, path)`` of this user's directory for the machine locks of ``s3://`` roots (see the
    module docstring), made if needed; DaemonError if it is not a private directory of this user.
    ``shm`` is for tests."""
    path = private_dir_in(shm, _s3_lock_dir_name(), os.getuid())
    hint = (
        f"make it private again (chmod 700 {path}), or remove it while no ckptd daemon of yours on "
        "an s3:// root runs on this machine (its only content is their lock files)"
    )
    fd = open_private_dir(
        path,
        what="the directory of ckptd's machine locks of s3:// roots",
        holds="the locks that keep two of your jobs off one root",
        hint=hint,
        refuse_open_mode=True,
    )
    return fd, path


class RootLock:
    """``<root>/.ckptd-n<node>.lock``, held by a node daemon for its lifetime (see the module
    docstring). ``shm`` (where an ``s3://`` root's lock directory goes) is for tests."""

    def __init__(self, root: Location, node: int, job: str, *, shm: Path = SHM_DIR) -> None:
        self.node = node
        self.where = str(root)
        self.shm = shm
        self.root: Path
        if isinstance(root, S3Location):
            # The user's lock directory: which one is known once acquire() made or found it.
            self.root, self.name = shm / _s3_lock_dir_name(), f"{_s3_lock_stem(root)}{node}.lock"
        else:
            self.root, self.name = root, node_lock_name(node)
        self.removed_on_release = isinstance(root, S3Location)
        self.fd: int | None = None
        self.acquired = False  # held, or the filesystem cannot lock (tolerated)

    def acquire(self, *, runtime_dir: Path, job: str) -> None:
        """Take the lock and record this daemon in it; raise RootBusyError when another daemon
        holds it. A filesystem that cannot lock is logged and tolerated.

        The lock is held on a descriptor open for reading only, so the daemon keeps no file of the
        root open for writing (a filesystem with a file open for writing cannot be remounted
        read-only); only where ``flock`` is emulated with POSIX locks, which need a file open for
        writing (NFS: EBADF on a read-only descriptor), is it taken on a read-write one."""
        if self.removed_on_release:
            dir_fd, self.root = open_s3_lock_dir(self.shm)
        else:
            dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd, writable = self._lock(dir_fd)
            if fd < 0:
                self.acquired = True  # tolerated: the filesystem cannot lock (logged)
                return
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "job": job,
                "runtime_dir": str(runtime_dir),
                "since_unix_s": round(time.time(), 3),
            }
            record = json.dumps(holder).encode()
            if writable:
                os.ftruncate(fd, 0)
                os.pwrite(fd, record, 0)
            else:  # another descriptor: closing it leaves the flock of ``fd`` in place
                w = os.open(self.name, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    os.write(w, record)
                finally:
                    os.close(w)
        finally:
            os.close(dir_fd)
        self.fd = fd
        self.acquired = True

    def _lock(self, dir_fd: int) -> tuple[int, bool]:
        """``(fd, writable)`` holding the exclusive lock; ``(-1, False)`` where locking is not
        possible; raises RootBusyError when another daemon holds it."""
        # O_NONBLOCK: a FIFO planted at the lock's name would block the open (and the daemon's
        # start) for good; it is refused below as not a regular file.
        flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_CREAT | os.O_NONBLOCK
        for mode in (os.O_RDONLY, os.O_RDWR):
            try:
                fd = os.open(self.name, mode | flags, 0o600, dir_fd=dir_fd)
            except OSError as exc:
                owner = _owner(self.name, dir_fd)
                raise StorageError(
                    f"cannot open the lock file {self.root / self.name} of {self.where} ({exc.strerror}, "
                    f"{errno.errorcode.get(exc.errno or 0, '?')}{owner}): the node daemon takes it before it "
                    "writes there. Give this user write access to the root, or remove a lock file another "
                    "user's job left (it is only a lock)"
                ) from exc
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise StorageError(
                    f"the lock file {self.root / self.name} of {self.where} is not a regular file: the node "
                    "daemon takes it before it writes there. Remove it (it is only a lock)"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise RootBusyError(self._busy_message(holder)) from None
                os.close(fd)
                if exc.errno == errno.EBADF and mode == os.O_RDONLY:
                    continue  # flock emulated by POSIX locks (NFS): a descriptor open for writing
                log.warning(
                    "cannot lock %s (%s): a second job saving into %s is not detected on this filesystem",
                    self.root / self.name,
                    exc,
                    self.where,
                )
                return -1, False
            if self.removed_on_release and not still_named(fd, self.name, dir_fd):
                os.close(fd)  # locked a file its holder removed on release: lock the new one
                return self._lock(dir_fd)
            return fd, mode == os.O_RDWR
        return -1, False

    def release(self) -> None:
        """Release the lock. The file in a POSIX root stays; the machine's file of an ``s3://``
        root is removed first, still locked (see the module docstring)."""
        if self.fd is not None:
            if self.removed_on_release:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.root / self.name)
            os.close(self.fd)
            self.fd = None
        self.acquired = False

    def _busy_message(self, holder: dict) -> str:
        who = (
            f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, runtime directory "
            f"{holder.get('runtime_dir', '?')}"
        )
        return (
            f"another ckptd daemon ({who}) serves node {self.node} of the checkpoint root {self.where}. "
            "Two jobs saving into one root would remove each other's saves in flight and retire each "
            "other's checkpoints, so this one is refused: give each job its own root. If that daemon "
            "belongs to an earlier launch of this job, it exits CKPTD_IDLE_EXIT_S after its last save "
            "commits, or stop it (`ckptd daemon stop --root ...` with its CKPTD_RUNTIME_DIR, or kill "
            "its pid); then start again"
        )


def recorded_holders(root: Location, shm: Path = SHM_DIR) -> dict[int, dict]:
    """What the daemons that took ``root``'s node locks recorded in them (:meth:`RootLock.acquire`),
    by node: the last holder of each, alive or not (a lock file in a POSIX root stays; those of an
    ``s3://`` root are this user's). Read without taking the locks: a probe while a daemon starts
    would make it refuse to start. ``shm`` is for tests."""
    if isinstance(root, S3Location):
        lock_dir = find_private_dir(shm, _s3_lock_dir_name(), os.getuid())
        if lock_dir is None:
            return {}
        where, prefix, suffix = lock_dir, _s3_lock_stem(root), ".lock"
    else:
        where, prefix, suffix = Path(root), LOCK_PREFIX, LOCK_SUFFIX
    try:
        dir_fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return {}
    found: dict[int, dict] = {}
    try:
        for name in os.listdir(dir_fd):
            node = name[len(prefix) : -len(suffix)]
            if not (name.startswith(prefix) and name.endswith(suffix) and node.isdigit() and len(node) < 7):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    found[int(node)] = _read_holder(fd)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return found


def _read_holder(fd: int) -> dict:
    try:
        raw = os.pread(fd, _HOLDER_MAX_NBYTES, 0)
        holder = json.loads(raw)
    except (OSError, ValueError, RecursionError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _owner(name: str, dir_fd: int) -> str:
    """``; owned by uid N`` for an existing file another user owns, else ``""``."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return ""
    return f"; owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else ""
