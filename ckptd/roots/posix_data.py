"""A rank's data file in a POSIX root: written under a private ``.part`` name inside the attempt's
directory, fsynced, renamed into place by path, the directory fsynced.

The attempt's directory ``<root>/iter_<step>.<attempt>.tmp`` is created by the first write (on a
writer thread), so a root the daemon may not write (permissions, read-only or full filesystem)
fails that save on its handle; a link in its place fails it with StorageError naming the link,
and the ``.part`` file is created relative to the directory's fd, so nothing is written through a
link planted in the root (see ckptd.format.safefs). The final rename goes *by path* relative to
the root's fd and only while that name still is the directory written into: a write that outlives
its attempt therefore never rewrites a file of a committed checkpoint (once the attempt's
directory was renamed by its commit, the rename fails instead).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import StorageError
from ..format.durable import Opener
from ..format.items import PlannedItem, write_data_file
from ..format.layout import data_file_name
from ..format.records import ItemRecord
from ..format.rootlayout import part_file_name
from ..format.safefs import Dir


class PosixDataTarget:
    """``__<rank>_0.distcp`` of one attempt (see the module docstring and ckptd.roots.base.DataTarget)."""

    def __init__(self, directory: Path, rank: int, opener: Opener, fsync: bool) -> None:
        """``directory``: the attempt's (``<root>/iter_<step>.<attempt>.tmp``), made if absent."""
        self.root = directory.parent
        self.step_name = directory.name
        self.name = data_file_name(rank)
        self.part = part_file_name(self.name, secrets.token_hex(8))
        self.opener = opener
        self.fsync = fsync
        self._rootd: Dir | None = None
        self._stepd: Dir | None = None

    @property
    def directory(self) -> Path:
        return self.root / self.step_name

    def _open(self) -> Dir:
        try:
            rootd = Dir.open(self.root, create=True)
            try:
                # Held so that the .part file can be removed wherever the directory was renamed to meanwhile.
                self._stepd = rootd.subdir(self.step_name, create=True)
            except BaseException:
                rootd.close()
                raise
        except OSError as exc:
            raise StorageError.from_oserror(exc, self.directory) from exc
        self._rootd = rootd
        return self._stepd

    def write(
        self,
        items: list[PlannedItem],
        *,
        checksums: bool,
        ready: Callable[[int], None],
        written: Callable[[int], None],
        produced: Callable[[int], bool] | None = None,  # a file frees each item as it is written
    ) -> list[ItemRecord]:
        stepd = self._open()
        try:
            stored = write_data_file(stepd, self.part, items, self.opener, self.fsync, checksums, ready, written)
        except OSError as exc:
            raise StorageError.from_oserror(exc, self.directory / self.part) from exc
        return [dataclasses.replace(r, relative_path=self.name) for r in stored]

    def publish(self) -> int:
        rootd, stepd = self._rootd, self._stepd
        if rootd is None or stepd is None:
            raise StorageError(f"{self.directory / self.name}: published before it was written")
        try:
            st = rootd.lstat(self.step_name)
            if st is None or not stat.S_ISDIR(st.st_mode) or not os.path.samestat(st, os.fstat(stepd.fd)):
                raise OSError(
                    errno.ENOENT,
                    f"{os.strerror(errno.ENOENT)} (renamed or replaced meanwhile)",
                    str(self.directory),
                )
            os.rename(
                f"{self.step_name}/{self.part}",
                f"{self.step_name}/{self.name}",
                src_dir_fd=rootd.fd,
                dst_dir_fd=rootd.fd,
            )
            st = stepd.lstat(self.name)
            nbytes = st.st_size if st is not None else -1
            if self.fsync:
                stepd.fsync()  # the new name is durable before WRITTEN goes out
        except OSError as exc:  # discard() removes the .part file, wherever its directory went
            raise StorageError.from_oserror(exc, self.directory / self.part) from exc
        self._close()
        return nbytes

    def discard(self) -> None:
        try:
            if self._stepd is not None:
                self._stepd.unlink(self.part)
        except OSError:
            pass  # the attempt's directory goes with its abort, or `ckptd gc`
        finally:
            self._close()

    def _close(self) -> None:
        for d in (self._stepd, self._rootd):
            if d is not None:
                d.close()
        self._stepd = self._rootd = None
