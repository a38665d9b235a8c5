"""Which mirror copies a resume passes over as copies of commits the local root abandoned
(ckptd.client.abandoned): pure rules on a root's commit records and tracker, no store."""

from __future__ import annotations

from pathlib import Path

from ckptd.client.abandoned import abandoned_locally
from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.roots.mirror import CommitRef

COPIED_AT = 1.0e9 + 100  # when the mirror's copy was made
A = "0123456789ab-1"


def _commit(root: Path, step: int, seq: int, at: float, attempt: str = A) -> None:
    directory = root / step_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    rec = CommitRecord(seq=seq, step=step, attempt=attempt, committed_unix_s=at)
    (directory / COMMIT_RECORD).write_bytes(rec.to_bytes())


def _latest(root: Path, step: int) -> None:
    (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(step)))


def _copy_of(step: int, seq: int) -> tuple[CommitRef, CommitRecord]:
    """The mirror's copy of the local commit (step, seq): what it copies, and its own record."""
    source = {"attempt": A, "seq": seq}
    return CommitRef(step=step, attempt=A, seq=seq), CommitRecord(
        seq=1, step=step, attempt="fedcba987654-1", committed_unix_s=COPIED_AT, source=source
    )


def test_the_copy_of_the_local_latest_or_of_an_older_commit_is_kept(tmp_path):
    _commit(tmp_path, 30, 3, COPIED_AT - 10)
    _latest(tmp_path, 30)
    assert abandoned_locally(tmp_path, *_copy_of(30, 3)) is None  # the local latest itself
    _commit(tmp_path, 40, 4, COPIED_AT + 10)
    _latest(tmp_path, 40)
    assert abandoned_locally(tmp_path, *_copy_of(30, 3)) is None  # the mirror lags behind


def test_a_copy_of_a_step_saved_again_after_a_rollback_is_abandoned(tmp_path):
    _commit(tmp_path, 20, 2, COPIED_AT - 20)
    _commit(tmp_path, 25, 4, COPIED_AT + 10)
    _commit(tmp_path, 30, 5, COPIED_AT + 20, attempt="0123456789ab-2")  # B replaced A
    _latest(tmp_path, 30)
    assert "replaced since" in str(abandoned_locally(tmp_path, *_copy_of(30, 3)))


def test_a_copy_above_the_rollback_point_is_abandoned_on_the_disk_it_copied_and_on_a_new_one(tmp_path):
    # The disk the copy is of: its tracker names a lower step of a later seq.
    old = tmp_path / "old"
    _commit(old, 25, 5, COPIED_AT + 10)
    _latest(old, 25)
    assert "abandoned" in str(abandoned_locally(old, *_copy_of(40, 4)))
    # A replaced disk numbers its commits from 1 again: its rollback below the copy is told by time
    # (it resumed the abandoned copy, as the higher step).
    new = tmp_path / "new"
    _commit(new, 60, 1, COPIED_AT + 10)
    _latest(new, 60)
    assert "abandoned" in str(abandoned_locally(new, *_copy_of(100, 57)))
    # ... and a commit of that lower step made before the copy is no rollback past it.
    _commit(new, 60, 1, COPIED_AT - 10)
    assert abandoned_locally(new, *_copy_of(100, 57)) is None
