"""The two-tier decisions as pure functions (ckptd.roots.mirror): what the mirror copies next, and
which level a job resumes from."""

from __future__ import annotations

from ckptd.format.commitrecord import CommitRecord, parse_commit_record
from ckptd.roots.mirror import LOCAL, MIRROR, CommitRef, FailedUpload, next_upload, resume_level


def ref(step: int, attempt: str = "", seq: int = 0) -> CommitRef:
    return CommitRef(step=step, attempt=attempt or f"a{step}", seq=seq or step)


def test_the_mirror_copies_only_the_newest_local_commit_it_lacks():
    assert next_upload(None, None, None, 0.0) is None
    assert next_upload(ref(10), None, None, 0.0) == ref(10)
    assert next_upload(ref(30), ref(10), None, 0.0) == ref(30)  # 20 was overtaken: skipped
    assert next_upload(ref(30), ref(30), None, 0.0) is None
    # a re-save of a step after a rollback is another commit: copied again
    assert next_upload(ref(30, "b30"), ref(30), None, 0.0) == ref(30, "b30")


def test_a_failed_copy_waits_for_its_retry_unless_a_newer_step_committed():
    failed = FailedUpload(commit=ref(30), retry_at_s=100.0)
    assert next_upload(ref(30), ref(10), failed, 99.0) is None
    assert next_upload(ref(30), ref(10), failed, 100.0) == ref(30)
    assert next_upload(ref(40), ref(10), failed, 50.0) == ref(40)


def test_a_resume_reads_the_local_root_unless_it_lacks_what_the_mirror_has():
    assert resume_level(ref(30), None, local_holds_mirrored=False) == LOCAL
    assert resume_level(None, ref(30), local_holds_mirrored=False) == MIRROR  # a replaced node
    assert resume_level(ref(40), ref(30), local_holds_mirrored=False) == LOCAL  # the mirror lags
    assert resume_level(ref(30), ref(30), local_holds_mirrored=True) == LOCAL
    assert resume_level(ref(10), ref(30), local_holds_mirrored=False) == MIRROR  # a disk restored from old
    # a rollback to step 10 after 30 was mirrored: the local root still holds 30, so it knows better
    assert resume_level(ref(10, seq=5), ref(30, seq=4), local_holds_mirrored=True) == LOCAL
    # node-local disks that disagree: every rank reads the mirror
    assert resume_level(ref(40), ref(30), local_holds_mirrored=False, same_on_every_rank=False) == MIRROR


def test_a_commit_record_carries_the_local_commit_it_copies():
    rec = CommitRecord(seq=3, step=30, attempt="m", committed_unix_s=1.0, source={"seq": 7, "attempt": "a30"})
    assert parse_commit_record(rec.to_bytes(), "x") == rec
    assert b"source" not in CommitRecord(seq=3, step=30, attempt="m", committed_unix_s=1.0).to_bytes()
    bad = rec.to_bytes().replace(b'"seq": 7', b'"seq": "7"')
    assert parse_commit_record(bad, "x") is None  # damaged: counted as committed before every recorded commit
