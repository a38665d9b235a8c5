"""A resume with a mirror passes over the mirror's copies of commits a rollback abandoned.

After a rollback the job saves a step again (commit B of step N); the mirror's latest copy may
still be of the commit of step N the rollback abandoned (A), copied before it. While B loads, the
local root wins (its commit order says B is later); when B is damaged, the mirror's copy of A
looked like the newest checkpoint, and the job resumed the abandoned branch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..catalog import abandoned_commit, read_tracker
from ..errors import CorruptCheckpointError, StorageError
from ..format.commitrecord import CommitRecord, read_commit_record_checked
from ..format.rootlayout import parse_step_dir, step_dir_name
from ..recovery import LatestChoice, resolve_resumable
from ..roots.mirror import CommitRef
from ..s3catalog import read_s3_commit_record
from ..storage.s3client import S3Client
from ..storage.url import S3Location

# How many of the mirror's newest copies a resume passes over as copies of abandoned commits
# (each costs a scan of the mirror); past them the mirror level is not used.
MAX_ABANDONED_COPIES = 8

log = logging.getLogger(__name__)


def past_abandoned_copies(
    root: Path,
    mirror: S3Location,
    choice: LatestChoice | None,
    damaged: dict[str, str],
    *,
    allow_unsafe_pickle: bool = False,
) -> tuple[LatestChoice | None, CommitRecord | None, CommitRef | None, str | None]:
    """The mirror's resolved ``choice``, or the copy before it while it is of a commit ``root``
    abandoned (:func:`abandoned_locally`): ``(choice, its commit record, the local commit it
    copies, why the mirror has none)``."""
    for _ in range(MAX_ABANDONED_COPIES):
        if choice is None:
            return None, None, None, None
        record = read_s3_commit_record(S3Client(mirror), choice.entry.name)
        source = None if record is None else record.source
        mirrored = (
            None
            if source is None or choice.step is None
            else CommitRef(step=choice.step, attempt=str(source["attempt"]), seq=int(source["seq"]))
        )
        abandoned = None if mirrored is None or record is None else abandoned_locally(root, mirrored, record)
        if abandoned is None:
            return choice, record, mirrored or _plain(choice), None
        log.info("%s", abandoned)
        damaged = {**damaged, str(choice.entry.path): abandoned}
        try:
            choice = resolve_resumable(
                mirror, damaged=damaged, log_fallback=False, allow_unsafe_pickle=allow_unsafe_pickle
            )
        except CorruptCheckpointError as exc:
            return None, None, None, str(exc)
    return None, None, None, f"the mirror's newest {MAX_ABANDONED_COPIES} copies are of commits {root} abandoned"


def _plain(choice: LatestChoice) -> CommitRef | None:
    """A copy that copies no commit of a root (ckptd.save's, another tool's): attempt ""."""
    return None if choice.step is None else CommitRef(step=choice.step, attempt="", seq=0)


def abandoned_locally(root: Path, mirrored: CommitRef, copy: CommitRecord) -> str | None:
    """Why the mirror's copy (``copy``, of the local commit ``mirrored``) is of a commit the local
    ``root`` abandoned since, or None:

    - its commit of the step is another one, committed after the copy was made: the step was
      saved again after a rollback (by time: a replaced disk numbers its commits from 1 again, so
      its order says nothing of the copied disk's; the times are node 0's clocks, the
      coordinator's and its mirror thread's). A fresh disk that saves the step it resumed from
      the copy again looks the same: its resume then goes back a step further, never to another
      branch;
    - its tracker names a lower step committed after the copied commit (:func:`abandoned_commit`),
      or after the copy was made (a replaced disk): the job rolled back below the copied step.
    """
    if not mirrored.attempt:
        return None
    local = _record(root / step_dir_name(mirrored.step))
    if (
        local is not None
        and (local.attempt, local.seq) != (mirrored.attempt, mirrored.seq)
        and local.committed_unix_s > copy.committed_unix_s
    ):
        return (
            f"the mirror's copy of step {mirrored.step} (commit {mirrored.attempt}, seq {mirrored.seq}) is of a "
            f"commit the local root replaced since: its step {mirrored.step} is commit {local.attempt} "
            f"(seq {local.seq}), committed after the copy (the step was saved again after a rollback)"
        )
    if abandoned_commit(root, mirrored.step, mirrored.seq) or _lower_step_since(root, mirrored.step, copy):
        return (
            f"the mirror's copy of step {mirrored.step} (commit {mirrored.attempt}, seq {mirrored.seq}) is of a "
            "commit the local root abandoned: its latest is a lower step committed after it (a rollback)"
        )
    return None


def _lower_step_since(root: Path, step: int, copy: CommitRecord) -> bool:
    """Whether ``root``'s tracker names a step below ``step`` committed after the mirror's
    ``copy`` of it was made: the job rolled back below the copied step since. By time, since a
    replaced disk's commit order is not the copied disk's (:func:`abandoned_commit` compares
    orders: a disk that rolled back after the copy of its own commit)."""
    _, name, problem = read_tracker(root)
    parsed = None if problem or name is None else parse_step_dir(name)
    if name is None or parsed is None or parsed.partial or parsed.deleting or parsed.step >= step:
        return False
    latest = _record(root / name)
    return latest is not None and latest.committed_unix_s > copy.committed_unix_s


def _record(directory: Path) -> CommitRecord | None:
    """``directory``'s commit record; None without one, or one that cannot be read (nothing is
    known of it: the resume's own look at the root says what is wrong there, once)."""
    try:
        return read_commit_record_checked(directory)
    except (CorruptCheckpointError, StorageError):
        return None
