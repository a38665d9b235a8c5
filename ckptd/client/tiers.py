"""Which level a Checkpointer with a mirror reads from: its local root or the object-store mirror
(the decision: :func:`ckptd.roots.mirror.resume_level`).

Order for one resume (:meth:`ckptd.Checkpointer.load` without ``step``), on every rank:

1. :meth:`Levels.resume` resolves the latest intact checkpoint of each level
   (:func:`ckptd.recovery.resolve_resumable`) and the local commit the mirror's copies;
2. with torch.distributed initialized, the ranks gather what each found locally (one
   ``all_gather_object`` of a few bytes): a rank that sees another local checkpoint than the
   others (node-local disks, a replaced node) makes every rank read the mirror;
3. the level's root is loaded as without a mirror (:func:`ckptd.client.resume.load_latest`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..dist import DistContext
from ..errors import CheckpointNotFoundError, CkptdError, SaveTimeoutError
from ..format.commitrecord import read_commit_record
from ..format.rootlayout import step_dir_name
from ..recovery import LatestChoice, resolve_resumable
from ..roots.mirror import MIRROR, CommitRef, resume_level
from ..s3catalog import committed_at, read_s3_commit_record
from ..storage.s3client import S3Client
from ..storage.url import Location, S3Location, UnsupportedLocationError, join, parse_location

_POLL_S = 0.5


def mirror_location(mirror: str, root: Location) -> S3Location | None:
    """The ``mirror`` setting checked (an ``s3://`` prefix the credentials reach, of a local
    root), or None when it is empty."""
    if not mirror:
        return None
    where = parse_location(mirror)
    if not isinstance(where, S3Location):
        raise UnsupportedLocationError(
            f"config mirror={mirror!r}: a mirror is an s3://bucket/prefix (checkpoints of {root} are copied there)"
        )
    if isinstance(root, S3Location):
        raise CkptdError(
            f"config mirror={mirror!r}: the root {root} is on object storage already; a mirror is the second "
            "tier of a local root (a node-local disk or a shared filesystem)"
        )
    S3Client(where).check_access()  # credentials, endpoint and bucket work, or a clear error now
    return where


class Levels:
    def __init__(self, root: Location, mirror: S3Location | None) -> None:
        self.root = root
        self.mirror = mirror

    def resume(
        self, damaged: dict[str, str], *, collective: bool = False, group: Any = None
    ) -> tuple[Location, LatestChoice | None]:
        """The root to resume from and its latest intact checkpoint (steps 1-2 above);
        ``collective``: every rank calls it."""
        local_choice = resolve_resumable(self.root, damaged=damaged)
        if self.mirror is None or not isinstance(self.root, Path):  # no mirror without a local root
            return self.root, local_choice
        local_record = None if local_choice is None else read_commit_record(local_choice.entry.path)
        local = _ref(local_choice, None if local_record is None else (local_record.attempt, local_record.seq))
        same = True
        if collective:
            found = DistContext.current(group).all_gather(local)
            same = len(set(found)) == 1
        mirror_choice = resolve_resumable(self.mirror, damaged=damaged)
        source = None
        if mirror_choice is not None:
            record = read_s3_commit_record(S3Client(self.mirror), mirror_choice.entry.name)
            source = None if record is None else record.source
        mirrored = _ref(mirror_choice, None if source is None else (str(source["attempt"]), int(source["seq"])))
        holds = mirrored is not None and _local_holds(self.root, mirrored)
        if resume_level(local, mirrored, local_holds_mirrored=holds, same_on_every_rank=same) == MIRROR:
            return self.mirror, mirror_choice
        return self.root, local_choice

    def step_location(self, step: int) -> Location:
        """Where ``iter_<step>`` is read from: the local root, or the mirror when only it has the step."""
        if self.mirror is not None and not committed_at(self.root, step) and committed_at(self.mirror, step):
            return join(self.mirror, step_dir_name(step))
        return join(self.root, step_dir_name(step))

    def wait_mirrored(self, step: int, timeout_s: float) -> None:
        """Return once the mirror holds ``step`` committed; SaveTimeoutError after ``timeout_s``."""
        if self.mirror is None:
            raise CheckpointNotFoundError(f"{self.root} has no mirror (config mirror='s3://bucket/prefix')")
        deadline = time.monotonic() + timeout_s
        while not committed_at(self.mirror, step):
            if time.monotonic() >= deadline:
                raise SaveTimeoutError(
                    f"step {step} was not copied to the mirror {self.mirror} within {timeout_s:.0f} s; the "
                    "coordinator's daemon status ('mirror' in Checkpointer.status() on node 0, or `ckptd "
                    "status`) says what the upload is doing or why it failed"
                )
            time.sleep(_POLL_S)


def _ref(choice: LatestChoice | None, commit: tuple[str, int] | None) -> CommitRef | None:
    """The commit a resolved checkpoint is: ``commit`` (attempt, seq) from its record (or, for a
    mirror's, the local commit it copies); none known: attempt "" (a checkpoint of ckptd.save,
    DCP or Megatron-Core, or a mirror's that copies nothing)."""
    if choice is None or choice.step is None:
        return None
    attempt, seq = commit if commit is not None else ("", 0)
    return CommitRef(step=choice.step, attempt=attempt, seq=seq)


def _local_holds(root: Path, commit: CommitRef) -> bool:
    if not commit.attempt:
        return False
    record = read_commit_record(root / step_dir_name(commit.step))
    return record is not None and (record.step, record.attempt, record.seq) == (commit.step, commit.attempt, commit.seq)
