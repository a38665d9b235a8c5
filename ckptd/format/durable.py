"""Durability primitives: fsync of files and directories, atomic file replacement.

The order matters for crash consistency: file data is fsynced before the rename that publishes
it, and the directory is fsynced after the rename so the new name survives a power loss.

Files are created relative to their directory's fd and never through a link (see
:mod:`ckptd.format.safefs`): a ``latest.tmp`` planted as a link to a file elsewhere is removed,
not written through.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol, cast

from ..errors import StorageError
from .safefs import AtPath, Dir, create_fd, located

ATOMIC_TMP_SUFFIX = ".tmp"


class WriteFile(Protocol):
    """What ckptd writes a file through: a binary file opened for writing, or a
    :class:`~ckptd.format.direct.DirectFile`."""

    def write(self, data: Any, /) -> int: ...
    def tell(self) -> int: ...
    def flush(self) -> None: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: Any) -> Any: ...


Opener = Callable[[str, str], WriteFile]
"""``opener(path, mode)``: open ``path`` (``mode`` "wb") for writing. ckptd passes an
:class:`~ckptd.format.safefs.AtPath` where it holds the directory open; its own openers create
such a path exclusively relative to that directory, never through a link."""


def default_opener(path: str, mode: str) -> BinaryIO:
    if "w" not in mode:
        return cast(BinaryIO, open(path, mode))
    return cast(BinaryIO, os.fdopen(create_fd(path), mode))


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durably(path: Path, *, fsync: bool) -> None:
    """``mkdir -p path``, with ``fsync`` each directory it creates fsynced into its parent, so that
    a root made for the first checkpoint survives a power loss with the checkpoint (its commit
    fsyncs the root itself, not the root's entry in its parent). A checkpoint root ``path`` that
    is, or lies under, something else than a directory (a file) is a StorageError saying so."""
    missing = []
    at = path
    while not at.is_dir():
        if os.path.lexists(at) and not at.is_dir():  # again: another rank may have made it just now
            raise _not_a_directory(at, path)
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise _not_a_directory(d, path) from None
            continue  # made by another process meanwhile: its maker syncs it
        if fsync:
            fsync_dir(d.parent)


def _not_a_directory(at: Path, root: Path) -> StorageError:
    kind = f"a symbolic link to {os.readlink(at)!r}" if at.is_symlink() else "a file"
    if at == root:
        return StorageError(
            f"the checkpoint root {root} is {kind}, not a directory: give the path of a directory "
            "(a missing one is created), or move that file away"
        )
    return StorageError(
        f"{at} is {kind}, not a directory, so the checkpoint root {root} cannot be made under it: "
        "choose another root, or move that file away"
    )


def atomic_tmp_name(name: str) -> str:
    """The name :func:`atomic_write` writes ``name``'s new content under before renaming it."""
    return name + ATOMIC_TMP_SUFFIX


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[WriteFile], object],
    opener: Opener = default_opener,
    fsync: bool = True,
) -> None:
    """Write ``path`` via ``<path>.tmp``: write, flush, fsync, rename, fsync the directory.

    The previous file (if any) stays in place until the rename replaces it atomically. An OSError
    names the file it concerns in full (see :func:`~ckptd.format.safefs.located`). Everything
    happens relative to one open directory (an :class:`AtPath`'s, else ``path``'s parent opened
    once); a stale ``.tmp`` entry (a crash's leftover, or a planted link) is removed first, never
    followed, and a link at ``path`` itself is replaced, not written through.
    """
    if isinstance(path, AtPath):
        parent, name, owned = Dir(path.dir_fd, Path(path).parent), path.entry, False
    else:
        path = Path(path)
        parent, name, owned = Dir.open(path.parent), path.name, True
    tmp = atomic_tmp_name(name)
    try:
        parent.unlink(tmp)
        try:
            try:
                with opener(parent.entry(tmp), "wb") as f:
                    write(f)
                    f.flush()
                    if fsync:
                        os.fsync(f.fileno())
            except OSError as exc:
                if exc.filename is not None:  # the open's own error
                    raise
                # The kernel names no file for a failed write or fsync, nor does the close that
                # tries again to flush what a failed flush left in the buffer.
                raise located(exc, parent.path / tmp) from exc
            try:
                os.replace(tmp, name, src_dir_fd=parent.fd, dst_dir_fd=parent.fd)
            except OSError as exc:
                raise located(exc, parent.path / tmp, parent.path / name) from exc
        except BaseException:
            parent.unlink(tmp)
            raise
        if fsync:
            parent.fsync()
    finally:
        if owned:
            parent.close()


def atomic_write_bytes(
    path: str | os.PathLike, data: bytes, opener: Opener = default_opener, fsync: bool = True
) -> None:
    atomic_write(path, lambda f: f.write(data), opener, fsync)
