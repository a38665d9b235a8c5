"""POSIX shared-memory segments in /dev/shm, created owner-only and unlinked explicitly.

Not ``multiprocessing.shared_memory``: its resource tracker unlinks a segment when the creating
process exits, but a ckptd segment must outlive the trainer that filled it (the daemon owns the
bytes once a save was acknowledged). Lifetime rules:

- a rank *creates* its segments (``O_EXCL``, mode 0600, pre-faulted) and registers them with its
  node daemon; from then on the daemon owns them and unlinks them (pool released, rank gone,
  daemon shutdown);
- a rank unlinks its own segments only when no daemon took them over (registration failed, or
  the daemon died);
- a daemon starting up unlinks every segment of its job and node: no other daemon can own them
  (the pid-file lock guarantees one daemon per job and node).
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from pathlib import Path

import torch

from ..errors import StagingError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise StagingError(f"invalid shared-memory segment name {name!r}")


class ShmSegment:
    """A mapped segment ``/dev/shm/<name>``; :attr:`base` is a uint8 tensor over all its bytes."""

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap) -> None:
        self.name = name
        self.nbytes = nbytes
        self._mm: mmap.mmap | None = mm
        self.base: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8) if nbytes else None

    @property
    def path(self) -> Path:
        return SHM_DIR / self.name

    @classmethod
    def create(cls, name: str, nbytes: int, prefault: bool = True) -> "ShmSegment":
        """Create a new segment (fails if the name exists) and fault all its pages in now.

        Touching fresh shared pages costs far more than a warm copy, so it is paid once here
        instead of inside every save.
        """
        _check_name(name)
        if nbytes <= 0:
            raise StagingError(f"segment {name}: size must be positive, got {nbytes}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
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
                "be too small: reduce CKPTD_POOL_SLOTS or enlarge /dev/shm"
            ) from exc
        os.close(fd)
        seg = cls(name, nbytes, mm)
        if prefault:
            try:
                seg._populate()
            except BaseException:
                seg.close()
                seg.unlink()
                raise
        return seg

    def _populate(self) -> None:
        if self._mm is None:
            return
        try:
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        try:
            self._mm.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            if self.base is not None:
                self.base.fill_(0)  # older kernels: write faults page by page
        # tmpfs allocates pages lazily; a full /dev/shm shows up as SIGBUS later, so check now.
        st = os.stat(self.path)
        if st.st_blocks * 512 < self.nbytes:
            raise StagingError(
                f"shared-memory segment {self.path} got {st.st_blocks * 512} of {self.nbytes} bytes; "
                "/dev/shm is full: reduce CKPTD_POOL_SLOTS or enlarge /dev/shm"
            )

    @classmethod
    def attach(cls, name: str, nbytes: int) -> "ShmSegment":
        """Map an existing segment; it must be a regular file of this user, mode 0600, ``nbytes`` long."""
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
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, nbytes, mm)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes ``[offset, offset + nbytes)`` without a copy (release it before :meth:`close`)."""
        if self._mm is None:
            raise StagingError(f"segment {self.name} is not mapped")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise StagingError(f"segment {self.name}: range [{offset}, {offset + nbytes}) outside "
                               f"its {self.nbytes} bytes")
        return memoryview(self._mm)[offset : offset + nbytes]

    def close(self) -> None:
        """Unmap (the segment itself stays until unlinked)."""
        self.base = None
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


def list_segments(prefix: str) -> list[str]:
    """Names of segments in /dev/shm starting with ``prefix``."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def unlink_segments(prefix: str) -> list[str]:
    """Unlink every segment named ``prefix*`` (crash leftovers of one job and node)."""
    removed = []
    for name in list_segments(prefix):
        try:
            os.unlink(SHM_DIR / name)
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
