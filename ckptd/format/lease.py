"""Leases that keep a checkpoint directory in place while a load reads it.

Order of one load (:func:`ckptd.load`):

1. :meth:`ReadLease.acquire` opens the checkpoint directory and takes a *shared* ``flock`` on it
   (non-blocking), then checks that the path still names that directory (same device and inode);
2. the load reads ``metadata.json``, ``.metadata``, the data files and ``common.pt``;
3. :meth:`ReadLease.release` closes the directory, which drops the lock.

Order of one removal (:func:`ckptd.retention.remove_entry`, for the commit's ``keep_last`` and
``ckptd gc``): :func:`try_exclusive` takes an *exclusive* non-blocking ``flock`` on the
directory; a directory with a lease held is skipped (it is removed at a later collection),
otherwise it is renamed to ``*.deleting`` and deleted with the lock held.

So a load that holds its lease never loses its directory to retention, and one that starts while
retention removes it gets :class:`~ckptd.errors.CheckpointRemovedError` (the lock is taken, or
the path no longer names the directory it opened) instead of reading half a checkpoint.

Where ``flock`` on a directory is not available (NFS maps ``flock`` to POSIX byte-range locks,
which a directory opened read-only cannot take; some FUSE filesystems refuse it), loads go on
without a lease and retention removes without asking: a load that loses its directory then fails
with CheckpointRemovedError, never with a partial result. On filesystems where ``flock`` is not
coherent across machines (Lustre mounted ``-o localflock``), a lease protects against retention
on the same machine only (the coordinator's node runs the commit's retention).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from ..errors import CheckpointNotFoundError, CheckpointRemovedError

log = logging.getLogger(__name__)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# Errors that say the lock is taken (by retention removing the directory).
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN)


def removed_error(directory: object) -> CheckpointRemovedError:
    """The error of a load whose checkpoint (a directory, or an ``s3://`` prefix) went away."""
    return CheckpointRemovedError(
        f"checkpoint {directory} was removed or replaced while it was being loaded (by retention, "
        "`ckptd gc`, a re-save of its step after a rollback, or by hand); nothing of it was "
        "returned. Load another checkpoint (Checkpointer.load() without step= resolves the latest "
        "again by itself), or keep more checkpoints (keep_last)."
    )


class ReadLease:
    """A load's hold on a checkpoint directory (see the module docstring)."""

    def __init__(self, directory: Path, fd: int, held: bool) -> None:
        self.directory = directory
        self.fd = fd
        self.held = held  # False where the filesystem has no flock: nothing stops retention

    @classmethod
    def acquire(cls, directory: str | os.PathLike) -> ReadLease:
        """Open ``directory`` and lease it; raises CheckpointNotFoundError when it is not a
        directory and CheckpointRemovedError when it is being removed or was moved meanwhile."""
        path = Path(directory)
        try:
            fd = os.open(path, _DIR)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(
                f"{path} is not a directory; pass the directory of one checkpoint "
                "(for a Checkpointer root, use Checkpointer(root).load())"
            ) from None
        try:
            held = True
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in _BUSY:
                    raise removed_error(path) from None
                held = False
                log.debug("no lease on %s (flock: %s); a removal meanwhile fails this load cleanly", path, exc)
            lease = cls(path, fd, held)
            if lease.gone():
                raise removed_error(path)
        except BaseException:
            os.close(fd)
            raise
        return lease

    def gone(self) -> bool:
        """Whether the path no longer names the directory this lease opened (moved or removed)."""
        try:
            now = os.stat(self.directory)
        except OSError:
            return True
        st = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def try_exclusive(fd: int, path: Path) -> bool:
    """Take an exclusive lock on the open directory ``fd`` for its removal: False when a load
    holds a lease on it; True when taken, or when the filesystem has no flock (nothing to ask)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in _BUSY:
            return False
        log.debug("removing %s without a lock (flock: %s): loads there hold no lease", path, exc)
    return True
