"""Files of a checkpoint, opened relative to a directory fd and never through a symbolic link.

A checkpoint root may be writable by others (a shared project directory) and a checkpoint may come
from anywhere, so neither is trusted below the path the caller names:

- **Writing** (the daemon's data files, the commit's metadata files and trackers, retention): a
  :class:`Dir` is an open directory. Its subdirectories are opened with ``O_NOFOLLOW`` (a
  symlinked step directory is refused with :class:`~ckptd.errors.StorageError` naming it), files
  are created in it with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to its fd (:class:`AtPath`,
  :func:`create_fd`), and renames and removals name entries of it, so no link planted in the root
  ever redirects a write outside it.
- **Reading** (load, ``inspect``, ``verify``, resume): :func:`open_regular` opens only a regular
  file inside the directory: ``O_NOFOLLOW`` (a link is refused, not followed out of the
  checkpoint), ``O_NONBLOCK`` at open (a FIFO can neither block the open nor be read), ``fstat``
  ``S_ISREG`` after the open, and a size limit, each violation a
  :class:`~ckptd.errors.CorruptCheckpointError` naming the file.

The path a caller names (a checkpoint root, a checkpoint directory) is its own choice and may
contain links; the rules apply to what lies inside it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
from pathlib import Path
from typing import TypeGuard

from ..errors import CorruptCheckpointError, StorageError

_CREATE_EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_TRUNC = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def dir_mode_for(file_mode: int) -> int:
    """The mode of directories holding files of ``file_mode``: x wherever r is set (0o640 -> 0o750)."""
    return file_mode | (file_mode & 0o444) >> 2


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


class AtPath(str):
    """A path whose text names a file (for messages, and for openers that only take a path) and
    which also carries the open directory it lies in: ckptd's own openers (:func:`create_fd`)
    create ``entry`` relative to ``dir_fd``, so no component of the path is looked up again."""

    dir_fd: int
    entry: str

    def __new__(cls, text: str, dir_fd: int, entry: str) -> AtPath:
        self = super().__new__(cls, text)
        self.dir_fd = dir_fd
        self.entry = entry
        return self


def create_fd(path: str, mode: int = 0o666) -> int:
    """A new file at ``path``, open for writing, never through a link.

    An :class:`AtPath` is created exclusively (``O_EXCL``: its caller picked a fresh name or
    removed a stale one; an entry appearing meanwhile, a link included, fails the open). A plain
    path is truncated if it exists, but a link at its last component is refused (``O_NOFOLLOW``).
    The umask applies to ``mode``.
    """
    try:
        if isinstance(path, AtPath):
            return os.open(path.entry, _CREATE_EXCL, mode, dir_fd=path.dir_fd)
        return os.open(path, _CREATE_TRUNC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, "is a symbolic link; ckptd never writes through a link", str(path)) from None
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def located(exc: OSError, path: str | os.PathLike, path2: str | os.PathLike | None = None) -> OSError:
    """``exc`` naming ``path`` (and ``path2``) in full: the kernel names no file for a failed
    write or fsync, and an operation relative to a directory fd names only the entry."""
    if path2 is None:
        return OSError(exc.errno, exc.strerror or str(exc), str(path))
    return OSError(exc.errno, exc.strerror or str(exc), str(path), None, str(path2))


def same_file(fd: int, other_fd: int) -> bool:
    a, b = os.fstat(fd), os.fstat(other_fd)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def still_named(fd: int, name: str | os.PathLike, dir_fd: int | None = None) -> bool:
    """Whether ``name`` (in ``dir_fd``, or a path) still leads to the file open as ``fd``, not
    through a link: False once it was removed, or replaced by another file. A lock taken on a file
    that its last holder removed on release locks nothing anyone else can find."""
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    st = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


class Dir:
    """An open directory: entries are created, renamed and removed relative to its fd.

    Use as a context manager (or :meth:`close`). ``path`` is used for messages only.
    """

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False) -> Dir:
        """Open the directory ``path`` as the caller names it (``create``: with its parents)."""
        path = Path(path)
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return cls(os.open(path, _DIR), path)

    def subdir(self, name: str, *, create: bool = False) -> Dir:
        """Open the subdirectory ``name`` (``create``: make it if absent), refusing a link."""
        if create:
            try:
                os.mkdir(name, 0o777, dir_fd=self.fd)
            except FileExistsError:
                pass
        try:
            return Dir(os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=self.fd), self.path / name)
        except OSError as exc:
            st = self.lstat(name)
            if st is not None and stat.S_ISLNK(st.st_mode):
                raise StorageError(
                    f"{self.path / name} is a symbolic link (to {self._link_target(name)!r}); ckptd "
                    "never writes through a link inside a checkpoint root. Remove the link (someone "
                    "may have planted it to redirect checkpoints elsewhere)."
                ) from None
            raise OSError(exc.errno, exc.strerror, str(self.path / name)) from None

    def _link_target(self, name: str) -> str:
        try:
            return os.readlink(name, dir_fd=self.fd)
        except OSError:
            return "?"

    def entry(self, name: str) -> AtPath:
        """``name`` in this directory, for an opener (see :func:`create_fd`)."""
        return AtPath(str(self.path / name), self.fd, name)

    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's own status (a link is not followed), or None if there is no such entry."""
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise located(exc, self.path / name) from exc

    def is_real_dir(self, name: str) -> bool:
        st = self.lstat(name)
        return st is not None and stat.S_ISDIR(st.st_mode)

    def listdir(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError as exc:
            raise located(exc, self.path) from exc

    def rename(self, src: str, dst: str) -> None:
        """Rename the entry ``src`` to ``dst`` (a link is renamed itself, never followed)."""
        try:
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            raise located(exc, self.path / src, self.path / dst) from exc

    def unlink(self, name: str) -> bool:
        """Remove the non-directory entry ``name`` (a link itself); False if there was none."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise located(exc, self.path / name) from exc
        return True

    def remove_tree(self, name: str) -> None:
        """Remove the directory ``name`` and everything in it; a link named ``name`` is removed
        itself. Links inside are removed, never followed."""
        st = self.lstat(name)
        if st is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.path / name))
        if not stat.S_ISDIR(st.st_mode):
            self.unlink(name)
            return
        shutil.rmtree(name, dir_fd=self.fd)

    def fsync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise located(exc, self.path) from exc

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __str__(self) -> str:
        return str(self.path)


def entry_path(directory: Dir | str | os.PathLike, name: str) -> str:
    """``name`` in ``directory``: an :class:`AtPath` for an open :class:`Dir`, else a plain path."""
    if isinstance(directory, Dir):
        return directory.entry(name)
    return os.path.join(directory, name)


# --- reading ---------------------------------------------------------------------------------


def is_entry_name(name: object) -> TypeGuard[str]:
    """``name`` names an entry of a directory itself: no separator, not ``.``/``..``, no NUL."""
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\0" not in name
        and name not in (".", "..")
        and (os.altsep is None or os.altsep not in name)
    )


def check_entry_name(name: object, directory: str | os.PathLike, what: str) -> str:
    """``name`` if it names an entry of ``directory`` itself (see :func:`is_entry_name`)."""
    if not is_entry_name(name):
        raise CorruptCheckpointError(
            f"{what}: {name!r} is not the name of a file inside {directory}; the metadata is damaged "
            "or was written to reach files outside the checkpoint"
        )
    return name


def open_regular(
    directory: str | os.PathLike, name: str, what: str, max_nbytes: int | None = None, dir_fd: int | None = None
) -> tuple[int, int]:
    """Open ``directory/name`` for reading: ``(fd, size)``; the caller closes ``fd``.

    Only a regular file inside ``directory`` is opened (see the module docstring); ``max_nbytes``
    bounds its size. ``dir_fd``, when given, is ``directory`` open already. Raises
    CorruptCheckpointError naming the file for a link, a non-regular file or an oversized one;
    FileNotFoundError when it does not exist (callers say what its absence means).
    """
    check_entry_name(name, directory, what)
    path = os.path.join(directory, name)
    own_dir = dir_fd is None
    dfd = os.open(directory, _DIR) if dir_fd is None else dir_fd
    try:
        try:
            fd = os.open(name, _READ, dir_fd=dfd)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCheckpointError(
                    f"{what} {path} is a symbolic link; ckptd reads only regular files inside the "
                    "checkpoint directory and never follows a link out of it. Replace the link by "
                    "the file itself if you trust where it points."
                ) from None
            # A socket (ENXIO) or a device without a driver (ENODEV, ENXIO) cannot even be opened:
            # what it is, not an I/O error, says the checkpoint is damaged.
            if exc.errno in (errno.ENXIO, errno.ENODEV):
                try:
                    st = os.lstat(name, dir_fd=dfd)
                except OSError:
                    st = None
                if st is not None and not stat.S_ISREG(st.st_mode):
                    raise CorruptCheckpointError(
                        f"{what} {path} is a {_kind(st.st_mode)}, not a regular file; the checkpoint is "
                        "damaged (or was tampered with). Replace it by the real file or load another checkpoint."
                    ) from None
            raise OSError(exc.errno, exc.strerror, path) from None
    finally:
        if own_dir:
            os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"{what} {path} is a {_kind(st.st_mode)}, not a regular file; the checkpoint is "
                "damaged (or was tampered with). Replace it by the real file or load another checkpoint."
            )
        if max_nbytes is not None and st.st_size > max_nbytes:
            raise CorruptCheckpointError(
                f"{what} {path} has {st.st_size} bytes, more than the {max_nbytes} such a file can "
                "have; it is damaged or not a checkpoint file. Load another checkpoint."
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(
    directory: str | os.PathLike, name: str, what: str, max_nbytes: int, dir_fd: int | None = None
) -> bytes:
    """The whole of ``directory/name`` (see :func:`open_regular`, ``dir_fd`` too), at most
    ``max_nbytes`` long."""
    fd, size = open_regular(directory, name, what, max_nbytes, dir_fd=dir_fd)
    try:
        parts: list[bytes] = []
        total = 0
        while True:
            block = os.read(fd, min(max(size - total, 0) + 1, 16 << 20))
            if not block:
                break
            total += len(block)
            if total > max_nbytes:  # grew while being read
                raise CorruptCheckpointError(
                    f"{what} {os.path.join(directory, name)} grew beyond {max_nbytes} bytes while "
                    "being read; it is damaged or not a checkpoint file"
                )
            parts.append(block)
        return b"".join(parts)
    finally:
        os.close(fd)


def entry_exists(directory: str | os.PathLike, name: str) -> bool:
    """Whether ``directory`` has an entry ``name`` of any kind (a dangling link too)."""
    return os.path.lexists(os.path.join(directory, name))


def is_regular_file(path: str | os.PathLike) -> bool:
    """``path`` is a regular file itself (not a link to one)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def is_real_dir(path: str | os.PathLike) -> bool:
    """``path`` is a directory itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def lock_by(fd: int, deadline: float, poll_s: float = 0.02) -> bool:
    """Take the exclusive ``flock`` of ``fd``, retrying every ``poll_s`` until ``deadline``
    (monotonic); False then. Raises the OSError of a failure other than the lock being held."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        # A client's liveness probe holds the lock for microseconds; a daemon for good.
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
