"""The next commit's number (ckptd.roots.posix.next_commit_seq), decided from a scan of the root:
above every number a commit record holds, and no number at all while a record cannot be read.

A number given twice ordered the two commits by step: after a rollback (40 committed, then the job
went back to 20 and saved 25) the step it left, 40, passed for the newest commit. Retention then
removed the step the job had gone back to, and a daemon start pointed the tracker at 40.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.catalog import CheckpointEntry, DirUsage, EntryState, RootCatalog
from ckptd.errors import CorruptCheckpointError, StorageError
from ckptd.format.rootlayout import step_dir_name
from ckptd.roots.posix import next_commit_seq
from ckptd.storage.url import S3Location

ROOT = Path("/ckpts")


def _entry(step: int, state: EntryState, seq: int = 0, problem: str | None = None, io: bool = False) -> CheckpointEntry:
    name = step_dir_name(step)
    unreadable = {"record_unreadable": True} if io else {}
    return CheckpointEntry(
        name, ROOT / name, step, state, DirUsage(0, 0, 0.0), commit_seq=seq, record_problem=problem, **unreadable
    )


def _root(*last: CheckpointEntry) -> RootCatalog:
    """Commits 10, 20, 30 (numbers 1-3), then ``last``; the tracker names 30."""
    first = [_entry(step, EntryState.COMMITTED, seq) for seq, step in enumerate((10, 20, 30), start=1)]
    return RootCatalog(ROOT, entries=[*first, *last], tracker_exists=True, latest_name=step_dir_name(30))


def test_a_commit_is_numbered_above_a_checkpoint_that_lost_its_markers():
    """40 (number 4) lost metadata.json and .metadata: the resume fell back to 30, and the job's 31
    was numbered 4 too. With the markers restored, 40 passed for the newest commit."""
    cat = _root(_entry(40, EntryState.INCOMPLETE, seq=4))
    assert next_commit_seq(cat, 0, ROOT) == 5
    assert cat.highest_commit_seq == 4


def test_a_commit_record_the_storage_failed_to_return_fails_the_commit():
    """An I/O error reading 40's record (an NFS blip) left its number unknown; the commit was
    numbered 4, as 40 is."""
    problem = f"reading commit record {ROOT}/iter_0000040/ckptd_commit.json failed: Input/output error (EIO)"
    cat = _root(_entry(40, EntryState.COMMITTED, problem=problem, io=True))
    with pytest.raises(StorageError) as err:
        next_commit_seq(cat, 0, ROOT)
    said = str(err.value)
    assert "commit record of iter_0000040 cannot be read" in said and "(EIO)" in said, said
    assert "The save fails; the next save tries again" in said, said


@pytest.mark.parametrize("state", [EntryState.COMMITTED, EntryState.INCOMPLETE])
def test_a_damaged_commit_record_fails_every_commit_until_it_is_restored_or_moved(state):
    problem = f"{ROOT}/iter_0000040/ckptd_commit.json is damaged (Expecting value: line 1 column 1 (char 0))"
    cat = _root(_entry(40, state, problem=problem))
    with pytest.raises(CorruptCheckpointError) as err:
        next_commit_seq(cat, 0, ROOT)
    said = str(err.value)
    assert "commit record of iter_0000040 cannot be read" in said and "is damaged" in said, said
    assert f"until {ROOT}/iter_0000040/ckptd_commit.json is restored" in said, said
    assert "iter_0000040 is moved out of the root" in said, said


def test_a_damaged_commit_object_of_an_object_store_fails_the_commit_too():
    """An s3:// root's commit object that cannot be parsed (ckptd.s3catalog.DAMAGED): seq 0 before."""
    bucket = S3Location(bucket="b", prefix="r")
    damaged = _entry(40, EntryState.COMMITTED, problem="s3://b/r/iter_0000040/ckptd_commit.json is damaged")
    damaged.path = bucket.child("iter_0000040")  # type: ignore[assignment]
    with pytest.raises(CorruptCheckpointError, match=r"until s3://b/r/iter_0000040/ckptd_commit\.json is restored"):
        next_commit_seq(_root(damaged), 0, bucket)


def test_what_holds_no_commit_record_does_not_stop_the_numbering():
    """An object store's step with checkpoint metadata but no commit object (another tool's
    checkpoint: its problem is said, but it never had a number), a half-deleted step and an
    attempt in flight."""
    other_tool = _entry(50, EntryState.PARTIAL, problem="s3://b/r/iter_0000050 has checkpoint metadata but no ...")
    cat = _root(other_tool, _entry(60, EntryState.DELETING), _entry(70, EntryState.PARTIAL))
    assert next_commit_seq(cat, 0, ROOT) == 4
    assert next_commit_seq(cat, 9, ROOT) == 10  # a node's disk holds number 9 (node-local roots)
