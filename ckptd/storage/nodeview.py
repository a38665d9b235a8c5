"""One commit of node-local disks, read on one node (config ``node_local``; README "Two tiers").

With ``node_local`` each node's local root holds, after a commit C = (step N, attempt A, seq S),
``iter_N/`` with only the data files of its own ranks (``__<r>_0.distcp``) and the checkpoint's
small files, byte-identical on every node (``.metadata`` names every rank's file); a node whose
daemon died before its rename holds its data files in ``iter_N.A.tmp/`` instead. The mirror holds
a copy of C once the daemons made it: a commit record whose ``source`` is ``{"seq": S,
"attempt": A}`` and data objects ``__<r>_0.<M>.distcp``, byte-identical to the local files.

:func:`node_local_view` makes a private temporary directory that stands for C to the readers of
local checkpoints (ckptd.format.reader, the load executor), as ckptd.storage.s3view does for an
``s3://`` checkpoint. Order of one view:

1. one GET of the mirror's ``iter_N/ckptd_commit.json``: the copy of C, or none yet;
2. the small files (``metadata.json``, ``.metadata``, ``common.pt``) are copied from this node's
   ``iter_N/`` when its commit record is C (a read lease holds it while the view is open), else
   downloaded from the mirror's copy of C (checked against its commit record);
3. each data file a reader opens (:meth:`NodeLocalSource.open_file`) or announces
   (:meth:`NodeLocalSource.prefetch`) is this node's file of the same rank, in ``iter_N/`` of C,
   else in ``iter_N.A.tmp/``, unless the mirror's copy holds that rank's object with another size
   (then the local file is not trusted); otherwise it is the mirror's object of that rank,
   fetched into a sparse file by parallel ranged GETs (ckptd.storage.s3view.S3RangeSource): a
   range is never read before it was fetched;
4. when step 2 or 3 needs the mirror while it has no copy of C yet, the view polls for the copy
   (the daemons make it after each commit) for at most ``wait_s`` from the first need, then
   raises NodeFilesMissingError naming the ranks, the node and what to do.

Every check of a local load applies (coverage, sizes, CRC-32C of each item read whole): the
readers are the same. Nothing of another commit is read: a local ``iter_N/`` counts only with C's
commit record, an attempt directory's name carries C's attempt, and a mirror copy counts only with
C as its source. Messages name the local file or the mirror object, not the temporary file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..errors import CheckpointNotFoundError, CkptdError, CorruptCheckpointError, NodeFilesMissingError
from ..format.commitrecord import (
    COMMIT_RECORD,
    COMMIT_RECORD_MAX_NBYTES,
    CommitRecord,
    parse_commit_record,
    read_commit_record,
)
from ..format.layout import (
    data_file_name,
)
from ..format.lease import ReadLease
from ..format.rootlayout import step_dir_name, tmp_dir_name
from ..format.safefs import is_real_dir, open_regular
from .s3client import S3Client
from .s3view import (
    SMALL_FILES,
    S3RangeSource,
    SparseObject,
    download_small_files,
    sparse_object,
)
from .url import S3Location

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a view waiting for the mirror's copy asks for its commit record
# A rank's data file: ``__<rank>_0.distcp`` on a disk, ``__<rank>_0.<attempt>.distcp`` in a mirror.
_DATA_FILE = re.compile(r"^__(\d+)_0(?:\.[^/]+)?\.distcp$")


def data_file_rank(name: str) -> int | None:
    """The rank whose data file (local or mirrored) ``name`` is; None: not a name of ckptd's layout."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True, kw_only=True)
class NodeLocalCheckpoint:
    """Commit ``attempt`` (``seq`` in its root's commit order) of ``step``, as node ``node`` reads it:
    from its own disk ``root`` where it holds the files, else from ``mirror`` (the mirror's root),
    waiting at most ``wait_s`` for the mirror's copy when it needs one (see the module docstring).
    What :func:`ckptd.load` is given to load such a commit."""

    root: Path
    step: int
    attempt: str
    seq: int
    mirror: S3Location
    wait_s: float
    node: int = 0

    @property
    def name(self) -> str:
        return step_dir_name(self.step)

    def is_commit(self, record: CommitRecord | None) -> bool:
        """``record`` (of a local ``iter_<step>``) is this commit's."""
        return record is not None and (record.step, record.attempt, record.seq) == (self.step, self.attempt, self.seq)

    def is_copy(self, record: CommitRecord | None) -> bool:
        """``record`` (of the mirror's ``iter_<step>``) is a copy of this commit."""
        return (
            record is not None
            and record.step == self.step
            and record.source == {"seq": self.seq, "attempt": self.attempt}
        )

    @property
    def attempt_dir(self) -> Path:
        """Where this node's daemon wrote its files of the commit before renaming them into place."""
        return self.root / tmp_dir_name(self.step, self.attempt)

    def held_here(self) -> bool:
        """This node's disk holds files of the commit: in its ``iter_<step>/`` of the commit, or in
        the attempt's directory."""
        return self.is_commit(read_commit_record(self.root / self.name)) or is_real_dir(self.attempt_dir)

    def read_copy(self, client: S3Client | None = None) -> CommitRecord | None:
        """The commit record of the mirror's ``iter_<step>`` when it is a copy of this commit, else
        None; ``client``: one rooted at the mirror's ``iter_<step>/``."""
        client = client if client is not None else S3Client(self.mirror.child(self.name))
        got = client.get(COMMIT_RECORD, COMMIT_RECORD_MAX_NBYTES, "commit record")
        if got is None:
            return None
        record = parse_commit_record(got[0], client.url(COMMIT_RECORD))
        return record if self.is_copy(record) else None

    def __str__(self) -> str:
        where = f"commit {self.attempt} of step {self.step} on node {self.node}, mirror {self.mirror}"
        return f"{self.root / self.name} ({where})"


class _Local(NamedTuple):
    fd: int
    size: int
    path: Path


class NodeLocalSource:
    """The data files of one view (steps 3-4 of the module docstring): this node's files where it
    holds trusted ones, the mirror's objects otherwise. Thread-safe."""

    def __init__(self, where: NodeLocalCheckpoint, client: S3Client, tmp: Path) -> None:
        self.where = where
        self.client = client  # rooted at the mirror's iter_<step>/
        self.tmp = tmp
        self.copy: CommitRecord | None = None  # the mirror's copy of the commit, once seen
        self.local_dir: Path | None = None  # this node's iter_<step>/ when it is the commit
        self.small_from = ""  # where the small files came from (messages)
        self.shown: dict[str, str] = {}  # data file -> where its bytes come from (messages)
        self._lease: ReadLease | None = None
        self._local: dict[str, _Local] = {}
        self._remote: dict[str, SparseObject] = {}
        self._placed: set[str] = set()
        self._fetch = S3RangeSource(client, self._remote)
        self._lock = threading.RLock()
        self._deadline: float | None = None

    @property
    def fetched_nbytes(self) -> int:
        """Bytes fetched from the mirror so far."""
        return self._fetch.fetched_nbytes

    @property
    def local_files(self) -> dict[str, Path]:
        """The data files read from this node's disk, by the name ``.metadata`` gives them."""
        return {rel: local.path for rel, local in self._local.items()}

    # --- steps 1-2 -------------------------------------------------------------------------
    def open(self) -> None:
        self.copy = self._read_copy()
        lease = self._lease_local_commit()
        if lease is not None:
            self._copy_small_files(lease)
            self.small_from = str(lease.directory)
            return
        self._await_copy(self._no_metadata)
        location = self.where.mirror.child(self.where.name)
        download_small_files(self.client, location, self.tmp, self.copy)  # not None: awaited above
        self.small_from = str(location)

    def _lease_local_commit(self) -> ReadLease | None:
        """A read lease on this node's ``iter_<step>/`` when its commit record is the commit."""
        directory = self.where.root / self.where.name
        try:
            lease = ReadLease.acquire(directory)
        except CheckpointNotFoundError:  # absent, or being removed
            return None
        if not self.where.is_commit(read_commit_record(directory, dir_fd=lease.fd)):
            lease.release()
            return None
        self._lease, self.local_dir = lease, directory
        return lease

    def _copy_small_files(self, lease: ReadLease) -> None:
        for name, max_nbytes in SMALL_FILES:
            try:
                fd, _ = open_regular(lease.directory, name, name, max_nbytes, dir_fd=lease.fd)
            except FileNotFoundError:
                continue  # as in the directory itself: the readers say what its absence means
            with os.fdopen(fd, "rb") as src, open(self.tmp / name, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)

    # --- steps 3-4 ---------------------------------------------------------------------------
    def open_file(self, relative_path: str) -> tuple[int, int] | None:
        with self._lock:
            self._place([relative_path])
            local = self._local.get(relative_path)
            return None if local is None else (os.dup(local.fd), local.size)

    def prefetch(self, ranges: list[tuple[str, int, int]]) -> None:
        with self._lock:
            self._place(dict.fromkeys(rel for rel, _, _ in ranges))
        self._fetch.prefetch(ranges)  # only the mirror's files: local ones are not its objects

    def ensure(self, relative_path: str, offset: int, length: int) -> None:
        with self._lock:
            self._place([relative_path])
        self._fetch.ensure(relative_path, offset, length)

    def _place(self, names: Iterable[str]) -> None:
        """Decide where each data file of ``names`` not placed yet is read from (step 3), waiting
        for the mirror's copy when one is needed and missing (step 4)."""
        remote: list[tuple[str, int]] = []
        for rel in names:
            if rel in self._placed:
                continue
            rank = data_file_rank(rel)
            if rank is None:
                self._placed.add(rel)
                continue  # not ckptd's layout: the readers find no such file and say so
            local = self._open_local(rank)
            mirrored = self._copy_object(rank)
            if local is not None and mirrored is not None and mirrored[1] != local.size:
                log.warning(
                    "node %d: %s has %d bytes, the mirror's copy %s has %d: the local file is not trusted, "
                    "it is read from the mirror",
                    self.where.node,
                    local.path,
                    local.size,
                    self.client.url(mirrored[0]),
                    mirrored[1],
                )
                os.close(local.fd)
                local = None
            if local is not None:
                self._local[rel] = local
                self.shown[rel] = str(local.path)
                self._placed.add(rel)
            else:
                remote.append((rel, rank))
        if not remote:
            return
        self._await_copy(lambda: self._no_data(sorted({rank for _, rank in remote})))
        for rel, rank in remote:
            self._placed.add(rel)
            mirrored = self._copy_object(rank)
            if mirrored is None:
                continue  # the copy lacks it too: the readers report the file missing
            key, size = mirrored
            self._remote[rel] = sparse_object(self.where.mirror.child(self.where.name), self.tmp, rel, key, size)
            self.shown[rel] = self.client.url(key)

    def _open_local(self, rank: int) -> _Local | None:
        name = data_file_name(rank)
        places: list[tuple[Path, int | None]] = [(self.where.attempt_dir, None)]
        if self.local_dir is not None and self._lease is not None:
            places.insert(0, (self.local_dir, self._lease.fd))
        for directory, dir_fd in places:
            try:
                fd, size = open_regular(directory, name, "data file", dir_fd=dir_fd)
            except (FileNotFoundError, NotADirectoryError):
                continue
            return _Local(fd, size, directory / name)
        return None

    def _copy_object(self, rank: int) -> tuple[str, int] | None:
        """The mirror copy's data object of ``rank`` and its size (None: no copy, or no such object)."""
        objects = self.copy.objects if self.copy is not None else None
        found = [
            (name, info.get("nbytes", -1)) for name, info in (objects or {}).items() if data_file_rank(name) == rank
        ]
        if len(found) > 1:
            raise CorruptCheckpointError(
                f"the mirror's copy {self.client.url('')} of step {self.where.step} records several data objects "
                f"of rank {rank} ({', '.join(n for n, _ in found)}); it is damaged. Resume on the nodes that "
                "saved the step, or from an earlier one."
            )
        return found[0] if found else None

    def _read_copy(self) -> CommitRecord | None:
        return self.where.read_copy(self.client)

    def _await_copy(self, message: Callable[[], str]) -> None:
        """Return once the mirror holds a copy of the commit; NodeFilesMissingError with
        ``message()`` once ``wait_s`` passed since the view first needed it."""
        if self.copy is not None:
            return
        if self._deadline is None:
            self._deadline = time.monotonic() + self.where.wait_s
            log.info(
                "node %d: waiting up to %.0f s for the mirror's copy of step %d (commit %s)",
                self.where.node,
                self.where.wait_s,
                self.where.step,
                self.where.attempt,
            )
        while True:
            self.copy = self._read_copy()
            if self.copy is not None:
                return
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise NodeFilesMissingError(message())
            time.sleep(min(POLL_S, left))

    def _no_copy(self) -> str:
        w = self.where
        return (
            f"the mirror {w.mirror} has no copy of step {w.step} (waited {w.wait_s:.0f} s for the one the "
            "daemons make after each commit). Resume on the nodes that saved the step (their disks hold "
            f"these files), or once the copy is in the mirror (Checkpointer.wait_mirrored({w.step}); `ckptd "
            "status` on node 0 shows the copy and its errors); config mirror_timeout_s bounds this wait"
        )

    def _no_data(self, ranks: list[int]) -> str:
        w = self.where
        what = f"rank {ranks[0]}'s data file" if len(ranks) == 1 else f"the data files of ranks {ranks}"
        are = "is" if len(ranks) == 1 else "are"
        return (
            f"node {w.node} needs {what} of step {w.step} (commit {w.attempt}), which {are} on neither its "
            f"disk ({w.root / w.name}, {w.attempt_dir}) nor in the mirror: {self._no_copy()}"
        )

    def _no_metadata(self) -> str:
        w = self.where
        directory = w.root / w.name
        record = read_commit_record(directory) if directory.is_dir() else None
        held = (
            "absent"
            if not directory.is_dir()
            else f"commit {record.attempt} (seq {record.seq})"
            if record is not None
            else "no commit record"
        )
        return (
            f"node {w.node}'s disk does not hold commit {w.attempt} (seq {w.seq}) of step {w.step} ({directory}: "
            f"{held}), so the checkpoint's metadata must come from the mirror, and {self._no_copy()}"
        )

    # --- closing ---------------------------------------------------------------------------
    def rename_paths(self, exc: CkptdError) -> None:
        """Name the local files and mirror objects in an error raised about the view's files."""

        def shown(text: str) -> str:
            for rel in sorted(self.shown, key=len, reverse=True):
                text = text.replace(str(self.tmp / rel), self.shown[rel])
            return text.replace(str(self.tmp), self.small_from or str(self.where))

        exc.args = tuple(shown(a) if isinstance(a, str) else a for a in exc.args)

    def close(self) -> None:
        self._fetch.close()
        for local in self._local.values():
            os.close(local.fd)
        self._local.clear()
        if self._lease is not None:
            self._lease.release()


@dataclass(frozen=True)
class NodeLocalView:
    """The local stand-in of a node-local commit (see :func:`node_local_view`)."""

    directory: Path
    source: NodeLocalSource
    checkpoint: NodeLocalCheckpoint


@contextmanager
def node_local_view(where: NodeLocalCheckpoint, client: S3Client | None = None) -> Iterator[NodeLocalView]:
    """Open commit ``where`` for reading on this node (see the module docstring)."""
    client = client if client is not None else S3Client(where.mirror.child(where.name))
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-node-"))
    source = NodeLocalSource(where, client, tmp)
    try:
        try:
            source.open()
            yield NodeLocalView(tmp, source, where)
        except CkptdError as exc:
            source.rename_paths(exc)
            raise
    finally:
        source.close()
        shutil.rmtree(tmp, ignore_errors=True)
