"""The two-tier decisions as pure functions (ckptd.roots.mirror): what the mirror copies next, which
level a job resumes from, and whether the mirror's copy of a step is of the local commit of it."""

from __future__ import annotations

from ckptd.format.commitrecord import CommitRecord, parse_commit_record
from ckptd.format.rootlayout import step_dir_name
from ckptd.recovery import resolve_latest
from ckptd.roots.mirror import (
    LOCAL,
    MIRROR,
    CommitRef,
    FailedUpload,
    copies_commit,
    next_upload,
    orders_disagree,
    resume_level,
)
from tests.checkpoints import make_root, stamp_commits


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
    # An object without its size (ckptd verify and a resume's structural check read it: KeyError).
    sized = CommitRecord(seq=3, step=30, attempt="m", committed_unix_s=1.0, objects={"__0_0.m.distcp": {"nbytes": 9}})
    assert parse_commit_record(sized.to_bytes(), "x") == sized
    assert parse_commit_record(sized.to_bytes().replace(b'"nbytes": 9', b'"crc32c": 9'), "x") is None


def test_a_damaged_local_copy_of_the_mirrors_commit_gives_way_to_the_mirrors_copy():
    # Local 10/20/30, 30 mirrored; the local 30 is damaged, so the local root resolves 20 while it
    # still holds 30's commit record: the mirror's intact copy of 30 is the later commit.
    assert resume_level(ref(20), ref(30), local_holds_mirrored=True) == MIRROR
    # The mirror's copy of 30 damaged too: its copy of 20 against the local 20, the same commit
    assert resume_level(ref(20), ref(20), local_holds_mirrored=True) == LOCAL


def test_the_commit_order_decides_where_the_levels_provably_share_a_history():
    # A local root restored from before a rollback (latest 40 at seq 4); the mirror's latest copy
    # is 32 at seq 6, and it holds a copy of a commit of the restored root.
    stale, later = ref(40, seq=4), ref(32, seq=6)
    assert orders_disagree(stale, later)
    assert resume_level(stale, later, local_holds_mirrored=False, mirror_holds_local=True) == MIRROR
    # A rollback the local root made after the mirror's copy: the local commit is the later one.
    assert resume_level(ref(25, seq=7), ref(30, seq=6), local_holds_mirrored=False, mirror_holds_local=True) == LOCAL
    # No shared commit: a replaced node's new disk numbers its commits from 1 again, so its seqs
    # say nothing against the mirror's; the step decides (it saved on after resuming the mirror).
    assert resume_level(ref(40, seq=1), ref(30, seq=3), local_holds_mirrored=False) == LOCAL
    # Only a disagreement needs the proof, and only commits with records have seqs.
    assert not orders_disagree(ref(40, seq=5), ref(30, seq=3))
    assert not orders_disagree(CommitRef(step=40, attempt="", seq=0), ref(30))
    assert not orders_disagree(ref(40), None)


def test_wait_mirrored_counts_only_a_copy_of_the_commit_the_local_root_holds():
    old, new = ref(30, "a30", 3), ref(30, "b30", 5)  # step 30 before and after a rollback
    assert copies_commit(new, new, left_behind_locally=False)
    assert not copies_commit(old, new, left_behind_locally=False)  # the mirror's copy is the old branch's
    assert not copies_commit(None, new, left_behind_locally=False)  # a mirror step that copies nothing
    # The local step retired (retention): any copy, unless the local tracker shows it was left behind
    assert copies_commit(old, None, left_behind_locally=False)
    assert not copies_commit(old, None, left_behind_locally=True)
    # Node-local disks: a node's disk other than node 0's may lag (an older commit of the step)
    assert copies_commit(new, old, left_behind_locally=False, local_may_lag=True)
    assert not copies_commit(old, new, left_behind_locally=False, local_may_lag=True)


def test_a_checkpoint_found_damaged_is_left_out_by_name_everywhere_or_by_path_in_its_root_only(tmp_path):
    roots = [make_root(tmp_path / name, [10, 20], latest=20) for name in ("local", "other")]
    for root in roots:
        stamp_commits(root, [10, 20])
    local, other = roots
    name = step_dir_name(20)

    def resolved(damaged: dict[str, str]) -> int | None:
        choice = resolve_latest(local, damaged=damaged)
        return None if choice is None else choice.step

    assert resolved({}) == 20
    assert resolved({name: "bit rot"}) == 10  # a name: that checkpoint in any root
    assert resolved({str(local / name): "bit rot"}) == 10  # its own path
    assert resolved({str(other / name): "bit rot"}) == 20  # another root's copy of it


def test_an_unexpected_error_in_a_mirror_pass_is_reported_and_the_thread_goes_on(tmp_path, monkeypatch):
    """A bug (any exception, not only a storage error) in an upload pass: before, it ended the
    thread with a pass still due, so the daemon counted as busy forever (an auto-started one never
    exited) and nothing was mirrored until it restarted."""
    from types import SimpleNamespace

    from ckptd.daemon import mirror as mirror_mod
    from ckptd.roots.base import Recovery
    from tools.harness.waiting import wait_until

    calls = []

    def broken(root):
        calls.append(root)
        raise ValueError("a bug")

    monkeypatch.setattr(mirror_mod, "local_latest", broken)
    store = SimpleNamespace(display=lambda *a: "s3://bucket/m", recover=lambda nnodes: Recovery())
    uploader = mirror_mod.MirrorUploader(tmp_path, store, retry_after_s=0.05)  # type: ignore[arg-type]
    uploader.start()
    try:
        wait_until(lambda: len(calls) >= 2, 10, "a second pass after the failed one")
        assert uploader.status()["error"] == "unexpected error: ValueError: a bug" and not uploader.busy
    finally:
        uploader.stop(5)
