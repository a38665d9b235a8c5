"""POSIX shared-memory segments in /dev/shm, created owner-only and unlinked explicitly.

Not ``multiprocessing.shared_memory``: its resource tracker unlinks a segment when the creating
process exits, but a ckptd segment must outlive the trainer that filled it (the daemon owns the
bytes once a save was acknowledged). Lifetime rules:

- a rank *creates* its segments (``O_EXCL``, mode 0600, sparse) and registers them with its
  node daemon; from then on the daemon owns them and unlinks them (ring retired, rank gone,
  daemon shutdown);
- a rank unlinks its own segments only when no daemon took them over (registration failed, or
  the daemon died);
- a daemon starting up unlinks the segments of its job and node (:func:`remove_orphans`): no
  other daemon can own them (the pid-file lock guarantees one daemon per job and node).

Names are ``ckptd-<job>-n<node>-r<rank>-<generation>-s<index>`` (:func:`segment_name`; a staging
ring is one segment, index 0), the
generation 128 random bits: nobody can guess a name to occupy it first, and a name parses to
exactly one job and node, so cleaning up job ``llama`` never touches job ``llama-n0``'s segments.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SharedMemoryFullError, StagingError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# What follows a job's and node's prefix in the name of one of its segments.
_SEGMENT_TAIL = re.compile(r"r(\d+)-([0-9a-f]{32})-s(\d+)")


def new_generation() -> str:
    """The random part of a new ring's segment names (128 bits: unguessable)."""
    return secrets.token_hex(16)


def segment_name(prefix: str, rank: int, generation: str, index: int) -> str:
    """The name of segment ``index`` of ``rank``'s staging ring ``generation``; ``prefix`` is
    :attr:`ckptd.control.endpoints.Endpoints.shm_prefix` (``ckptd-<job>-n<node>-``)."""
    return f"{prefix}r{rank}-{generation}-s{index}"


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise StagingError(f"invalid shared-memory segment name {name!r}")


class ShmSegment:
    """A mapped segment ``/dev/shm/<name>``; :attr:`base` is a uint8 tensor over all its bytes
    (made on first use).

    tmpfs allocates a page when it is first written. A write *through the mapping* to a page that
    cannot be allocated (``/dev/shm`` full, by this job or by anyone) kills the process with
    SIGBUS, so a trainer never writes a ring through its mapping unreserved: it writes with
    :meth:`write` (``pwrite``: a full ``/dev/shm`` is an ENOSPC, raised as StagingError), and the
    paths that must write through the mapping (device-to-host copies, strided tensor copies)
    :meth:`reserve` the segment first (``posix_fallocate``). Nothing is pre-faulted: the first save
    allocates the pages it writes, outside ``save()`` for fork and lazy snapshots.
    """

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, fd: int = -1) -> None:
        self.name = name
        self.nbytes = nbytes
        self._mm: mmap.mmap | None = mm
        self._fd = fd  # kept by the creator, for pwrite and fallocate
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file checked and mapped
        self.reserved = False
        self._base: torch.Tensor | None = None

    @property
    def base(self) -> torch.Tensor | None:
        """A uint8 tensor over all the segment's bytes (None once closed). Made on first use: the
        node daemon, which maps the rings to read them, never uses it and never imports torch."""
        if self._base is None and self._mm is not None and self.nbytes:
            import torch

            self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._base

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    @classmethod
    def create(cls, name: str, nbytes: int) -> ShmSegment:
        """Create a new, sparse segment (fails if the name exists); see the class docstring."""
        _check_name(name)
        if nbytes <= 0:
            raise StagingError(f"segment {name}: size must be positive, got {nbytes}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise StagingError(f"shared-memory segment {path} already exists") from None
        except OSError as exc:
            raise StagingError(f"cannot create shared-memory segment {path}: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise StagingError(
                f"cannot size shared-memory segment {path} to {nbytes} bytes ({exc}); /dev/shm may "
                "be too small: lower CKPTD_STAGING_BUDGET or enlarge /dev/shm"
            ) from exc
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)  # fewer page faults for whoever fills it
        except (AttributeError, OSError):
            pass
        return cls(name, nbytes, mm, fd)

    def fileno(self) -> int:
        """The creator's descriptor of the segment (for ``pwrite``; -1 in the daemon)."""
        return self._fd

    def write(self, offset: int, data: Any) -> None:
        """``pwrite`` ``data`` (a buffer) at ``offset``; a full ``/dev/shm`` raises StagingError."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.nbytes:
            raise StagingError(
                f"segment {self.name}: write of {view.nbytes} bytes at {offset} outside its {self.nbytes} bytes"
            )
        try:
            while view.nbytes:
                done = os.pwrite(self._fd, view[:_CHUNK_NBYTES], offset)
                view, offset = view[done:], offset + done
        except OSError as exc:
            raise self.write_failed(exc, view.nbytes) from exc

    def reserve(self) -> None:
        """Allocate every page now (``posix_fallocate``), before writes through the mapping."""
        if self.reserved:
            return
        self.reserve_range(0, self.nbytes)
        self.reserved = True

    def reserve_range(self, offset: int, nbytes: int) -> None:
        """Allocate the pages of ``[offset, offset + nbytes)`` now (a full ``/dev/shm`` raises
        SharedMemoryFullError), before they are written through the mapping or pinned."""
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as exc:
            raise self.write_failed(exc, nbytes) from exc

    def check_room(self, nbytes: int) -> None:
        """Raise StagingError, before anything is written, when ``/dev/shm`` cannot hold the pages
        of the first ``nbytes`` bytes that are not allocated yet (a co-tenant may still take them
        afterwards: writes then fail cleanly, see :meth:`write`)."""
        missing = max(0, min(nbytes, self.nbytes) - allocated_nbytes(self._fd))
        if missing and missing > shm_free_nbytes():
            raise self.no_room(OSError(28, os.strerror(28)), missing)

    def write_failed(self, exc: OSError, nbytes: int) -> StagingError:
        """What a failed write or allocation of ``nbytes`` raises: SharedMemoryFullError when
        ``/dev/shm`` is full (the save fails with that reason), else the error as it is (told as
        a full /dev/shm, an EFAULT or EIO sent users freeing space that was there)."""
        if exc.errno in _FULL:
            return self.no_room(exc, nbytes)
        return StagingError(
            f"shared-memory segment {self.path}: writing {nbytes} bytes failed: {exc}. This save fails; "
            "training goes on and the next save retries"
        )

    def no_room(self, exc: OSError, nbytes: int) -> SharedMemoryFullError:
        return SharedMemoryFullError(
            f"shared-memory segment {self.path}: cannot place {nbytes} more bytes ({exc.strerror}); "
            f"/dev/shm has {shm_free_nbytes()} bytes free. This save fails; training goes on and the "
            "next save retries. Free /dev/shm, enlarge it (containers: --shm-size) or lower "
            "CKPTD_STAGING_BUDGET"
        )

    @classmethod
    def attach(cls, name: str, nbytes: int) -> ShmSegment:
        """Map an existing segment; it must be a regular file of this user, mode 0600, ``nbytes`` long.

        Not populated: the daemon only reads pages the rank has written (a page never written
        reads as zeros, never SIGBUS)."""
        _check_name(name)
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise StagingError(f"cannot open shared-memory segment {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise StagingError(f"shared-memory segment {path} is not a private (0600) file of this user")
            if st.st_size != nbytes:
                raise StagingError(f"shared-memory segment {path} has {st.st_size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        segment = cls(name, nbytes, mm)
        segment.identity = (st.st_dev, st.st_ino)
        return segment

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes ``[offset, offset + nbytes)`` without a copy (release it before :meth:`close`)."""
        if self._mm is None:
            raise StagingError(f"segment {self.name} is not mapped")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise StagingError(
                f"segment {self.name}: range [{offset}, {offset + nbytes}) outside its {self.nbytes} bytes"
            )
        return memoryview(self._mm)[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap (the segment itself stays until unlinked)."""
        self._base = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                # A tensor over the mapping is still alive somewhere; the mapping goes with it.
                log.warning("segment %s: still referenced, unmapped when the last view dies", self.name)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


_CHUNK_NBYTES = 64 << 20
# Errors of a write or allocation that mean the filesystem is full (tmpfs: ENOSPC; quota: EDQUOT).
_FULL = (errno.ENOSPC, errno.EDQUOT)


def allocated_nbytes(fd_or_path: int | str | os.PathLike) -> int:
    """Bytes tmpfs has allocated for a segment (its pages written or reserved so far)."""
    st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    return st.st_blocks * 512


def shm_free_nbytes() -> int:
    """Bytes an unprivileged user can still allocate in ``/dev/shm``."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def list_segments(prefix: str) -> list[str]:
    """Names of segments in /dev/shm starting with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def _own_regular_file(name: str) -> bool:
    """``/dev/shm/<name>`` is a regular file of this user (checked without following a link)."""
    try:
        st = os.lstat(SHM_DIR / name)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _unlink(names: list[str]) -> list[str]:
    removed = []
    for name in names:
        try:
            os.unlink(SHM_DIR / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def unlink_segments(prefix: str) -> list[str]:
    """Unlink every segment of this user named ``prefix*`` (tests and tools clean up with it)."""
    return _unlink([n for n in list_segments(prefix) if _own_regular_file(n)])


def remove_orphans(prefix: str) -> list[str]:
    """Unlink the segments a crashed daemon of one job and node left: named ``prefix`` (its
    :attr:`~ckptd.control.endpoints.Endpoints.shm_prefix`) plus a segment tail exactly, and
    regular files of this user. Anything else with that prefix (another job's, whose id merely
    starts alike; another user's file, which may not even be removable) is left alone and logged.
    """
    mine: list[str] = []
    foreign: list[str] = []
    for name in list_segments(prefix):
        if _SEGMENT_TAIL.fullmatch(name[len(prefix) :]) is None:
            continue  # another job's (e.g. job "llama-n0" for prefix "ckptd-llama-n0-"), or not ours
        (mine if _own_regular_file(name) else foreign).append(name)
    if foreign:
        log.warning(
            "left %d shared-memory files named like this node's segments alone: not regular "
            "files of this user (uid %d): %s",
            len(foreign),
            os.getuid(),
            foreign[:4],
        )
    return _unlink(mine)
