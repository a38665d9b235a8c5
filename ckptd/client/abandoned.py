"""A resume with a mirror passes over the mirror's copies of commits a rollback abandoned.

After a rollback the job saves a step again (commit B of step N); the mirror's latest copy may
still be of the commit of step N the rollback abandoned (A), copied before it. While B loads, the
local root wins (its commit order says B is later); when B is damaged, the mirror's copy of A
looked like the newest checkpoint, and the job resumed the abandoned branch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import CorruptCheckpointError
from ..format.commitrecord import CommitRecord, read_commit_record
from ..format.rootlayout import step_dir_name
from ..recovery import LatestChoice, resolve_resumable
from ..roots.mirror import CommitRef
from ..s3catalog import committed_at, read_s3_commit_record
from ..storage.s3client import S3Client
from ..storage.url import S3Location

# How many of the mirror's newest copies a resume passes over as copies of abandoned commits
# (each costs a GET or two); past them the mirror level is not used.
MAX_ABANDONED_COPIES = 8

log = logging.getLogger(__name__)


def past_abandoned_copies(
    root: Path, mirror: S3Location, choice: LatestChoice | None, damaged: dict[str, str]
) -> tuple[LatestChoice | None, CommitRecord | None, CommitRef | None, str | None]:
    """The mirror's resolved ``choice``, or the copy before it while it is of a commit ``root``
    replaced (:func:`replaced_locally`): ``(choice, its commit record, the local commit it copies,
    why the mirror has none)``."""
    for _ in range(MAX_ABANDONED_COPIES + 1):
        if choice is None:
            return None, None, None, None
        record = read_s3_commit_record(S3Client(mirror), choice.entry.name)
        source = None if record is None else record.source
        mirrored = (
            None
            if source is None or choice.step is None
            else CommitRef(step=choice.step, attempt=str(source["attempt"]), seq=int(source["seq"]))
        )
        replaced = None if mirrored is None or record is None else replaced_locally(root, mirrored, record)
        if replaced is None:
            return choice, record, mirrored or _plain(choice), None
        log.info("%s", replaced)
        damaged = {**damaged, str(choice.entry.path): replaced}
        try:
            choice = resolve_resumable(mirror, damaged=damaged, log_fallback=False)
        except CorruptCheckpointError as exc:
            return None, None, None, str(exc)
    return None, None, None, f"the mirror's newest {MAX_ABANDONED_COPIES} copies are of commits {root} replaced"


def _plain(choice: LatestChoice) -> CommitRef | None:
    """A copy that copies no commit of a root (ckptd.save's, another tool's): attempt ""."""
    return None if choice.step is None else CommitRef(step=choice.step, attempt="", seq=0)


def replaced_locally(root: Path, mirrored: CommitRef, copy: CommitRecord) -> str | None:
    """Why the mirror's copy (``copy``, of the local commit ``mirrored``) is of a commit the local
    ``root`` replaced: its commit of the step is a later one in both the commit order (a higher
    seq) and time (committed after the copy was made: a replaced disk's seqs start at 1 again, so
    the order alone could be another history's; the times are the coordinator's and its mirror
    thread's clocks), i.e. the step was saved again after a rollback; None when it is not (also
    when the local record cannot be read: nothing is known of it)."""
    local = read_commit_record(root / step_dir_name(mirrored.step)) if committed_at(root, mirrored.step) else None
    if local is None or not mirrored.attempt or local.seq <= mirrored.seq:
        return None
    if local.committed_unix_s <= copy.committed_unix_s:
        return None
    return (
        f"the mirror's copy of step {mirrored.step} (commit {mirrored.attempt}, seq {mirrored.seq}) is of a "
        f"commit the local root replaced since: its step {mirrored.step} is commit {local.attempt} (seq {local.seq}), "
        "committed after the copy (the step was saved again after a rollback), and cannot be loaded"
    )
