"""One interface for a checkpoint root, whatever stores it: where attempts are written, how one is
committed (the commit point), aborted, recovered after a crash, listed and read.

Two implementations, because a commit point needs one atomic operation and storage systems offer
different ones (as Orbax's ``TemporaryPath`` has a rename and a commit-file variant):

- :class:`~ckptd.roots.posix_root.PosixRoot`: a local or shared POSIX directory. An attempt is
  written into ``iter_<step>.<attempt>.tmp/`` and committed by renaming it to ``iter_<step>``
  (then ``fsync`` of the root): the rename is the commit point.
- :class:`~ckptd.roots.s3_root.S3Root`: an ``s3://bucket/prefix`` of S3-compatible object
  storage, which has no rename. Data objects are written under keys that name their attempt
  (never reused, so neither a re-save nor a late writer of a dead attempt can tear a committed
  step), the metadata objects are created once (``If-None-Match: *``), and the commit point is one
  small object written last, also create-only: ``iter_<step>/ckptd_commit.json``. Readers trust a
  step only through it.

Order of calls for one asynchronous save (roles in brackets):

1. [node daemons, writer threads] :meth:`RootStore.data_target` for each rank, then its
   :meth:`DataTarget.write` (items as they are produced), :meth:`DataTarget.publish` (durable
   under its final name; the size goes in WRITTEN), or :meth:`DataTarget.discard` after a failure;
2. [coordinator, commit thread] :meth:`RootStore.commit` once every rank wrote: validate, write
   the metadata, check every data file, the commit point, the ``latest`` tracker, retention;
3. [coordinator] :meth:`RootStore.abort` of an attempt that failed anywhere.

At a coordinator's start: :meth:`RootStore.recover`. Anyone: :meth:`RootStore.scan`,
:meth:`RootStore.committed_once`, :meth:`RootStore.checkpoint_location`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..catalog import RootCatalog, WentBack
from ..format.items import PlannedItem
from ..format.records import ItemRecord
from ..storage.url import Location


@dataclass(frozen=True, kw_only=True)
class CommitOutcome:
    """What a commit committed, and what it noticed on the way (told to the ranks)."""

    name: str
    warnings: tuple[str, ...] = ()
    # A node-local root's commit (ckptd.roots.nodelocal): the files every other node writes next to
    # its own data files, name -> bytes (empty otherwise).
    files: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Recovery:
    """What a coordinator's start found: a commit it finished (the tracker now names it), what it
    removed, attempts it adopted (other nodes may still be writing them), and what it kept."""

    finished: str | None = None
    removed: list[str] = field(default_factory=list)
    adopted: list[tuple[int, str]] = field(default_factory=list)
    # Why objects of uncommitted steps were kept: not provably a Checkpointer's (another tool's
    # checkpoint in the root), never removed.
    kept: list[str] = field(default_factory=list)


class DataTarget(Protocol):
    """Where one rank's data file of one attempt goes (see the module docstring, step 1)."""

    name: str  # the file's name inside the checkpoint, as ``.metadata`` records it

    def write(
        self,
        items: list[PlannedItem],
        *,
        checksums: bool,
        ready: Callable[[int], None],
        written: Callable[[int], None],
        produced: Callable[[int], bool] | None = None,
    ) -> list[ItemRecord]:
        """Write every item (``ready(i)`` before item ``i``, ``written(i)`` once its bytes may be
        overwritten); returns the stored records. Nothing is visible yet. ``produced(i)``: whether
        item ``i`` is complete already (``ready(i)`` would not wait; its producer may be waiting
        for the space of items written before, which a target must not hold back then)."""
        ...

    def publish(self) -> int:
        """Make the file durable under its final name; returns its size in bytes."""
        ...

    def discard(self) -> None:
        """After a failure: remove whatever was written (never raises)."""
        ...


class RootStore(Protocol):
    @property
    def location(self) -> Location:
        """The root: a directory, or an ``s3://`` prefix."""
        ...

    def display(self, *parts: str) -> str:
        """The path or URL of ``parts`` under the root, for messages."""
        ...

    def data_file_name(self, attempt: str, rank: int) -> str:
        """The name of a rank's data file of an attempt inside the checkpoint, as ``.metadata``
        records it."""
        ...

    def data_target(self, step: int, attempt: str, rank: int) -> DataTarget: ...

    def commit(
        self,
        step: int,
        attempt: str,
        records: list[ItemRecord],
        common: bytes,
        data_files: Mapping[str, tuple[int, int]],
        *,
        elsewhere: frozenset[str] = frozenset(),
        went_back: WentBack | None = None,
        went_back_agreed: bool = True,
        seq_floor: int = 0,
    ) -> CommitOutcome:
        """Commit the attempt (see the module docstring, step 2). ``data_files``: each rank's
        data file name -> ``(rank, bytes its writer reported)``; ``elsewhere``: those on other
        nodes' disks, which a node-local root cannot check (ckptd.roots.nodelocal); ``went_back``:
        the job went back to an older step (a commit of a step it left replaces it:
        :meth:`ckptd.catalog.RootCatalog.superseded`; never on node-local disks), and the commit
        descends from what it loaded (:func:`ckptd.lineage.parent_of`; ``went_back_agreed``
        False: the ranks named different steps, and the commit's parent is not recorded);
        ``seq_floor``: the commit is numbered above it (node-local disks: the highest commit
        number any node's disk holds)."""
        ...

    def highest_commit_seq(self) -> int:
        """The highest commit number this root holds (0: none): what a node reports of its disk
        (Written.disk_seq)."""
        ...

    def abort(self, step: int, attempt: str) -> None:
        """Remove what the attempt wrote (it never commits); retried, never raises."""
        ...

    def holds_commit(self, step: int, attempt: str, went_back: WentBack | None = None) -> bool:
        """``iter_<step>`` is committed by exactly that attempt (its commit record says so) on the
        current branch: a checkpoint a rollback abandoned, or one the reporting job left
        (``went_back``), is not held, so a remembered verdict of it never answers for a new save
        that repeats its attempt id (a second Checkpointer of a launch with a fixed
        ``CKPTD_RUN_ID`` names its saves as the first did)."""
        ...

    def committed_once(self, step: int, went_back: WentBack | None = None) -> bool:
        """``iter_<step>`` is committed and may not be saved again (a checkpoint of a branch a
        rollback abandoned, or one a job that ``went_back`` left, may: a new save of the step
        replaces it)."""
        ...

    def recover(self, *, nnodes: int) -> Recovery: ...

    def scan(self, *, usage: bool = True) -> RootCatalog: ...

    def checkpoint_location(self, step: int) -> Location:
        """Where ``iter_<step>`` is (committed or not)."""
        ...
