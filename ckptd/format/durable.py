"""Durability primitives: fsync of files and directories, atomic file replacement.

The order matters for crash consistency: file data is fsynced before the rename that publishes
it, and the directory is fsynced after the rename so the new name survives a power loss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, BinaryIO

Opener = Callable[[str, str], BinaryIO]


def default_opener(path: str, mode: str) -> BinaryIO:
    return open(path, mode)  # noqa: SIM115 - caller closes


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | os.PathLike,
    write: Callable[[BinaryIO], None],
    opener: Opener = default_opener,
    fsync: bool = True,
) -> None:
    """Write ``path`` via ``<path>.tmp``: write, flush, fsync, rename, fsync the directory.

    The previous file (if any) stays in place until the rename replaces it atomically.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with opener(str(tmp), "wb") as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, opener: Opener = default_opener,
                       fsync: bool = True) -> None:
    atomic_write(path, lambda f: f.write(data), opener, fsync)
