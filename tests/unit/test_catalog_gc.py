"""Scanning a checkpoint root and garbage-collecting it (library level, real directories)."""

import os
import time

import pytest

from ckptd.catalog import EntryState, abandoned_commit, committed_once, resolve_target, scan_root
from ckptd.errors import CheckpointNotFoundError, CkptdError, CorruptCheckpointError
from ckptd.format.rootlayout import step_dir_name
from ckptd.format.safefs import Dir
from ckptd.retention import apply_gc, plan_gc
from ckptd.roots.posix import check_data_files, finish_interrupted_commit
from tests.checkpoints import make_checkpoint, make_partial, make_root, stamp_commits


def test_scan_root_states_sizes_and_latest(tmp_path):
    root = make_root(tmp_path / "r", [100, 200, 300], latest=200)
    make_partial(root, 400, age_s=10)
    (root / "iter_0000050").mkdir()  # committed name, no marker
    (root / "iter_0000020.deleting").mkdir()
    (root / "notes.txt").write_text("hi")
    cat = scan_root(root)
    assert [(e.name, e.step, e.state) for e in cat.entries] == [
        ("iter_0000020.deleting", 20, EntryState.DELETING),
        ("iter_0000050", 50, EntryState.INCOMPLETE),
        ("iter_0000100", 100, EntryState.COMMITTED),
        ("iter_0000200", 200, EntryState.COMMITTED),
        ("iter_0000300", 300, EntryState.COMMITTED),
        ("iter_0000400.tmp", 400, EntryState.PARTIAL),
    ]
    assert cat.latest().name == "iter_0000200" and cat.tracker_problem is None
    assert cat.others == ["notes.txt"]
    full = cat.latest()
    assert full.usage.files == 5 and full.usage.nbytes == sum(p.stat().st_size for p in full.path.iterdir())
    assert step_dir_name(100) == "iter_0000100"


@pytest.mark.parametrize(
    "content, problem",
    [
        ("iter_0000999\n", "does not exist"),
        ("iter_0000050\n", "not a complete checkpoint"),
        ("../etc\n", "not a checkpoint directory name"),
    ],
)
def test_untrustworthy_tracker(tmp_path, content, problem):
    root = make_root(tmp_path / "r", [100], latest=None)
    (root / "iter_0000050").mkdir()
    (root / "latest").write_text(content)
    cat = scan_root(root)
    assert problem in cat.tracker_problem and cat.latest() is None


def test_resolve_target(tmp_path):
    make_checkpoint(tmp_path / "c")
    root = make_root(tmp_path / "r", [], latest=None)
    make_partial(root, 1, age_s=0)
    assert not resolve_target(tmp_path / "c").is_root
    assert resolve_target(root).is_root
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for bad, msg in (("nope", "does not exist"), ("empty", "neither a checkpoint"), ("file", "is a file")):
        with pytest.raises(CheckpointNotFoundError, match=msg):
            resolve_target(tmp_path / bad)


def test_gc_keeps_newest_and_latest_and_young_partials(tmp_path):
    root = make_root(tmp_path / "r", [100, 200, 300, 400], latest=200)  # latest is not the newest
    make_partial(root, 500, age_s=5)
    make_partial(root, 90, age_s=7200)
    (root / "iter_0000010.deleting").mkdir()
    plan = plan_gc(scan_root(root), keep=1, grace_s=600)
    assert [r.entry.name for r in plan.remove] == [
        "iter_0000010.deleting",
        "iter_0000090.tmp",
        "iter_0000100",
        "iter_0000300",
    ]
    kept = {e.name: why for e, why in plan.kept}
    assert kept == {
        "iter_0000400": "among the 1 last committed",
        "iter_0000200": "named by the tracker",
        "iter_0000500.tmp": kept["iter_0000500.tmp"],
    }
    assert "in flight" in kept["iter_0000500.tmp"]
    assert plan.nbytes > 0 and plan.refused is None
    results = apply_gc(plan)
    assert [err for _, err in results] == [None] * 4
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000200", "iter_0000400", "iter_0000500.tmp", "latest"]


def test_gc_renames_before_deleting(tmp_path, monkeypatch):
    root = make_root(tmp_path / "r", [100, 200], latest=200)
    import ckptd.format.safefs as safefs  # removals go through its Dir.remove_tree

    seen = []
    real_rmtree = safefs.shutil.rmtree

    def rmtree(path, *a, **k):
        seen.append(sorted(p.name for p in root.iterdir()))
        raise PermissionError(13, "simulated", str(path))

    monkeypatch.setattr(safefs.shutil, "rmtree", rmtree)
    [(removal, err)] = apply_gc(plan_gc(scan_root(root), keep=1))
    assert removal.entry.name == "iter_0000100" and "simulated" in err
    # The committed name was gone before any byte was deleted; a later gc finishes the job.
    assert seen == [["iter_0000100.deleting", "iter_0000200", "latest"]]
    monkeypatch.setattr(safefs.shutil, "rmtree", real_rmtree)
    [(removal, err)] = apply_gc(plan_gc(scan_root(root), keep=1))
    assert removal.entry.state is EntryState.DELETING and err is None
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000200", "latest"]


def test_gc_refuses_committed_removal_with_a_dangling_tracker(tmp_path):
    root = make_root(tmp_path / "r", [100, 200, 300], latest=None)
    (root / "latest").write_text("iter_0000999\n")
    make_partial(root, 400, age_s=7200)
    plan = plan_gc(scan_root(root), keep=1, grace_s=60)
    assert "does not exist" in plan.refused
    assert [r.entry.name for r in plan.remove] == ["iter_0000400.tmp"]


def test_gc_without_tracker_and_bad_arguments(tmp_path):
    root = make_root(tmp_path / "r", [100, 200], latest=None)
    plan = plan_gc(scan_root(root), keep=1, now=time.time())
    assert [r.entry.name for r in plan.remove] == ["iter_0000100"] and plan.refused is None
    with pytest.raises(CkptdError, match="keep must be >= 1"):
        plan_gc(scan_root(root), keep=0)


def test_retention_and_abandoned_steps_follow_commit_order_not_step_order(tmp_path):
    """Issue 25 H2: committed 10, 20, 30, 40, then (a rollback to 30) 31 and 32: the last
    commits are 32 and 31, whatever the step numbers say, and 40 belongs to the abandoned branch."""
    root = make_root(tmp_path / "r", [10, 20, 30, 31, 32, 40], latest=32)
    stamp_commits(root, [10, 20, 30, 40, 31, 32])
    cat = scan_root(root)
    assert [e.step for e in cat.newest_first] == [32, 31, 40, 30, 20, 10]
    assert cat.abandoned(40).step == 40 and cat.abandoned(30) is None and cat.abandoned(32) is None
    # The same answer from the tracker and two records, without a scan (holds_commit's question).
    seqs = {e.step: e.commit_seq for e in cat.committed}
    assert [abandoned_commit(root, step, seqs[step]) for step in (10, 20, 30, 31, 32, 40)] == [
        cat.abandoned(step) is not None for step in (10, 20, 30, 31, 32, 40)
    ]
    assert committed_once(root, 32) and not committed_once(root, 40) and not committed_once(root, 33)
    plan = plan_gc(cat, keep=2)
    assert [r.entry.step for r in plan.remove] == [10, 20, 30, 40]
    # Without commit records (older checkpoints) the order is the step order, as before.
    legacy = make_root(tmp_path / "legacy", [10, 20, 30], latest=20)
    assert [e.step for e in scan_root(legacy).newest_first] == [30, 20, 10]
    assert scan_root(legacy).abandoned(30) is None  # nothing recorded, nothing taken for abandoned


def test_retention_keeps_the_step_a_rollback_went_back_to_before_the_steps_it_left(tmp_path):
    """Committed 10, 20, 30, 40, then a rollback to 20 and a save of 25, keep 3: 25, 20 and 10 stay
    (the branch the job trains on), 30 and 40 go (the branch it rolled back from), though they were
    committed after 10 and 20. Before, 20, the step the job had just resumed from, was removed."""
    root = make_root(tmp_path / "r", [10, 20, 25, 30, 40], latest=25)
    stamp_commits(root, [10, 20, 30, 40, 25])
    cat = scan_root(root)
    assert [e.step for e in cat.branch_first] == [25, 20, 10, 40, 30]
    assert sorted(e.step for e in cat.off_branch()) == [30, 40]
    plan = plan_gc(cat, keep=3)
    assert [(r.entry.step, r.reason) for r in plan.remove] == [
        (30, "on a branch a rollback abandoned, committed before the 3 last committed"),
        (40, "on a branch a rollback abandoned, committed before the 3 last committed"),
    ]
    # An unusable tracker names no branch: commit order alone (and nothing committed is removed).
    (root / "latest").write_text("iter_0000099\n")
    cat = scan_root(root)
    assert [e.step for e in cat.branch_first] == [25, 40, 30, 20, 10] and cat.off_branch() == []
    assert plan_gc(cat, keep=3).remove == []


def test_retention_keeps_the_step_the_mirror_copies_until_a_newer_one_is(tmp_path):
    """Two tiers (ckptd.roots.mirror): the step ckptd_mirrored names stays beyond keep, and is not
    listed among the root's other names; a marker naming no committed step keeps nothing."""
    from ckptd.format.rootlayout import MIRRORED_FILE

    root = make_root(tmp_path / "r", [30, 35, 40], latest=35)
    stamp_commits(root, [30, 40, 35])  # a rollback: 35 committed after 40
    (root / MIRRORED_FILE).write_text("iter_0000040\n")
    cat = scan_root(root)
    assert cat.mirrored_name == "iter_0000040" and cat.others == []
    plan = plan_gc(cat, keep=1)
    assert [r.entry.step for r in plan.remove] == [30]
    assert any(e.step == 40 and "mirror" in why for e, why in plan.kept)
    for junk in ("iter_0000040.tmp", "../x", "latest"):
        (root / MIRRORED_FILE).write_text(junk)
        assert scan_root(root).mirrored_name is None
        assert [r.entry.step for r in plan_gc(scan_root(root), keep=1).remove] == [30, 40]


def test_a_restarted_coordinator_finishes_the_last_commit_not_the_highest_step(tmp_path):
    """A crash between a commit's rename and its tracker update: the successor points the tracker
    at the checkpoint committed last, also when a rollback made it a lower step."""
    root = make_root(tmp_path / "r", [30, 31, 40], latest=40)
    stamp_commits(root, [30, 40, 31])  # 31 was renamed into place after the rollback; then the crash
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) == "iter_0000031"
    assert (root / "latest").read_text() == "iter_0000031\n"
    # Nothing newer than the tracker's in commit order: the tracker stays, though 40 is a higher step.
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) is None
    assert (root / "latest").read_text() == "iter_0000031\n"


def test_a_commit_record_that_cannot_be_read_is_never_guessed_oldest(tmp_path):
    """The tracked checkpoint's commit record rots: its place in commit order is unknown. It used to
    count as the oldest commit, so a coordinator start moved the tracker back to step 20 (taken for
    a commit a crash interrupted), step 30 then stood on an "abandoned branch" (a save of it
    replaced it) and retention retired it first."""
    root = make_root(tmp_path / "r", [10, 20, 30], latest=30)
    stamp_commits(root, [10, 20, 30])
    (root / "iter_0000030" / "ckptd_commit.json").write_bytes(b'{"seq": 3, "st\xffep')
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) is None
    assert (root / "latest").read_text() == "iter_0000030\n"
    cat = scan_root(root)
    assert "iter_0000030/ckptd_commit.json is damaged" in (cat.latest().record_problem or "")
    assert cat.abandoned(30) is None and committed_once(root, 30)
    plan = plan_gc(cat, keep=1)
    assert [r.entry.step for r in plan.remove] == [10]  # 20: the last commit known in order; 30: tracked
    # Another checkpoint's damaged record: neither counted among the last commits nor retired, nor
    # taken for abandoned although the tracker names a lower step committed after it (as it seemed).
    (root / "latest").write_text("iter_0000020\n")
    cat = scan_root(root)
    assert cat.abandoned(30) is None and not cat.off_branch()
    plan = plan_gc(cat, keep=1)
    assert [r.entry.step for r in plan.remove] == [10]
    assert any(e.step == 30 and "place in commit order is unknown" in why for e, why in plan.kept)
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) is None


@pytest.mark.parametrize("moved", ["rollback", "forward"])
def test_a_collection_whose_tracker_moves_removes_only_what_a_fresh_plan_would(tmp_path, moved):
    """``ckptd gc --keep 2`` scanned 10, 20, 30 and planned to remove 10; meanwhile the job rolled
    back to 10 and committed 11. The scan's plan removed 10 (now second on the branch the job
    trains on) and kept 20 and 30 (abandoned). A tracker that moved forward changes nothing."""
    root = make_root(tmp_path / "r", [10, 20, 30], latest=30)
    stamp_commits(root, [10, 20, 30])
    plan = plan_gc(scan_root(root), keep=2)
    assert [r.entry.step for r in plan.remove] == [10]
    step = 11 if moved == "rollback" else 40
    make_checkpoint(root / step_dir_name(step), step=step)
    stamp_commits(root, [10, 20, 30, step])
    (root / "latest").write_text(f"{step_dir_name(step)}\n")
    results = apply_gc(plan)
    if moved == "rollback":
        assert results == [] and (root / "iter_0000010").is_dir()
        assert any(e.step == 10 and "the tracker moved since the scan" in why for e, why in plan.kept)
        assert [r.entry.step for r in plan_gc(scan_root(root), keep=2).remove] == [20, 30]
    else:
        assert [(r.entry.step, err) for r, err in results] == [(10, None)]
        assert not (root / "iter_0000010").exists()


def test_a_removal_checks_under_the_lock_that_the_step_is_what_was_scanned(tmp_path):
    """The last check, right before the rename (a collection's plan may be checked against a
    fresh scan before that, but the job commits meanwhile): a step named latest since the scan,
    or committed again (another seq), is not removed."""
    from ckptd.retention import CheckpointChanged, remove_entry

    root = make_root(tmp_path / "r", [10, 20], latest=20)
    stamp_commits(root, [10, 20])
    entry = next(e for e in scan_root(root).entries if e.step == 10)
    (root / "latest").write_text("iter_0000010\n")
    with pytest.raises(CheckpointChanged, match="is named latest now"):
        remove_entry(entry)
    (root / "latest").write_text("iter_0000020\n")
    stamp_commits(root, [20, 10])  # 10 committed again (after a rollback), with another seq
    with pytest.raises(CheckpointChanged, match="committed again since the scan"):
        remove_entry(entry)
    assert (root / "iter_0000010").is_dir()


def test_the_last_check_before_a_commit_names_what_is_wrong_with_each_data_file(tmp_path):
    """A data file its node reported written must be in the attempt's directory, a regular file of
    the reported size; a missing one says what a node-local disk per node would cause."""
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 8)
    (tmp_path / "__1_0.distcp").write_bytes(b"x" * 7)
    (tmp_path / "__2_0.distcp").symlink_to(tmp_path / "__0_0.distcp")
    with Dir.open(tmp_path) as tmpd:
        check_data_files(tmpd, {"__0_0.distcp": (0, 8)})
        cases = {
            "__3_0.distcp": (3, "is missing, though its node reported it written.*shared filesystem.*s3://"),
            "__1_0.distcp": (1, "has 7 bytes, its writer reported 8"),
            "__2_0.distcp": (2, "is not a regular file"),
        }
        for name, (rank, message) in cases.items():
            with pytest.raises(CorruptCheckpointError, match=f"rank {rank}'s data file .*{name} {message}"):
                check_data_files(tmpd, {"__0_0.distcp": (0, 8), name: (rank, 8)})


def test_gc_on_a_node_local_disk_keeps_what_was_written_after_its_last_commit(tmp_path):
    """A node of a node-local root that got COMMITTED but could not finish the step on its disk
    keeps its files in ``iter_N.<attempt>.tmp``, where the mirror copy and a resume read them: gc
    removed them once older than the grace period, although step N was the job's latest."""
    from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord

    root = make_root(tmp_path / "r", [100, 200], latest=200)
    for seq, step in enumerate((100, 200), start=1):
        rec = CommitRecord(
            seq=seq, step=step, attempt="0123456789ab-1", committed_unix_s=time.time() - 9000 + seq, objects={}
        )
        (root / step_dir_name(step) / COMMIT_RECORD).write_bytes(rec.to_bytes())
    make_partial(root, 50, age_s=10000)  # before the last commit, below the steps kept
    make_partial(root, 150, age_s=10000)  # before the last commit, among the steps kept
    make_partial(root, 300, age_s=7200)  # after it
    cat = scan_root(root)
    assert cat.node_local
    plan = plan_gc(cat, keep=2, grace_s=600)
    assert [r.entry.name for r in plan.remove] == ["iter_0000050.tmp"]
    kept = {e.name: why for e, why in plan.kept}
    # Step 150 may be a step committed on node 0 and still retained whose rename this node missed.
    assert "within the steps this disk keeps commits of" in kept["iter_0000150.tmp"]
    assert "within the steps this disk keeps commits of" in kept["iter_0000300.tmp"]
    plan = plan_gc(cat, keep=1, grace_s=600)  # 150 falls out of the window with 100
    assert [r.entry.name for r in plan.remove] == ["iter_0000050.tmp", "iter_0000100", "iter_0000150.tmp"]
    # A node's disk before its first commit there: its own node lock (not node 0's) tells.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / ".ckptd-n1.lock").write_text("{}")
    make_partial(bare, 10, age_s=7200)
    assert scan_root(bare).node_local
    assert plan_gc(scan_root(bare), keep=2, grace_s=600).remove == []
    (bare / ".ckptd-n0.lock").write_text("{}")  # a shared root holds node 0's lock too
    assert not scan_root(bare).node_local
    # A shared root (commit records without a file list): an abandoned save is collected.
    stamp_commits(root, [100, 200])
    assert not scan_root(root).node_local
    assert [r.entry.name for r in plan_gc(scan_root(root), keep=2, grace_s=600).remove] == [
        "iter_0000050.tmp",
        "iter_0000150.tmp",
        "iter_0000300.tmp",
    ]


def test_gc_of_a_root_megatron_lm_wrote_keeps_the_step_its_tracker_names(tmp_path):
    """Without ckptd's ``latest``, gc kept the K newest steps and removed the one
    latest_checkpointed_iteration.txt names, which Megatron-LM resumes."""
    root = make_root(tmp_path / "r", [10, 20, 30, 40], latest=None)
    (root / "latest_checkpointed_iteration.txt").write_text("20")
    plan = plan_gc(scan_root(root), keep=1, grace_s=600)
    assert [r.entry.step for r in plan.remove] == [10, 30]
    assert any(e.step == 20 and "Megatron-LM's tracker" in why for e, why in plan.kept)
    # Next to ckptd's tracker too: Megatron-LM, saving into the root after ckptd did, resumes it.
    (root / "latest").write_text("iter_0000040\n")
    assert [r.entry.step for r in plan_gc(scan_root(root), keep=1, grace_s=600).remove] == [10, 30]


def test_a_commit_record_listing_thousands_of_files_is_read(tmp_path):
    """A node-local commit record lists every rank's data file: at 2,000 ranks some 90 KiB. Read
    with a 4 KiB limit it was taken for damaged (beyond ~80 ranks), and the commit order, rollback
    and the node view broke with it."""
    from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord, read_commit_record

    root = make_root(tmp_path / "r", [100], latest=100)
    objects = {f"__{r}_0.0123456789ab-1.distcp": {"nbytes": 1 << 30} for r in range(2000)}
    rec = CommitRecord(seq=7, step=100, attempt="0123456789ab-1", committed_unix_s=1.0e9, objects=objects)
    raw = rec.to_bytes()
    assert len(raw) > 64 << 10
    (root / step_dir_name(100) / COMMIT_RECORD).write_bytes(raw)
    assert read_commit_record(root / step_dir_name(100)) == rec
    assert scan_root(root).committed[0].commit_seq == 7


@pytest.mark.parametrize("undone", [True, False])
def test_a_commit_whose_tracker_fails_is_taken_back_or_said_to_be_in_place(tmp_path, monkeypatch, undone):
    """The tracker's write fails after the rename: the checkpoint is renamed back and the commit
    fails (its ranks are told it aborted). When the rename back fails too it stays complete in
    place, and the next start names it latest: the commit stands, with a warning for its ranks.
    It used to fail, so its ranks were told it aborted (and node-local peers removed their files
    of it) although a resume would load it."""
    import errno
    import os

    from ckptd.format.durable import default_opener
    from ckptd.roots.posix import publish_step

    root = make_root(tmp_path / "r", [10], latest=10)
    make_checkpoint(root / "iter_0000020.abc-1.tmp")

    def opener(path, flags, mode=0o644):  # the tracker's temporary file cannot be written
        if os.path.basename(path).startswith("latest"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return default_opener(path, flags, mode)

    rename = Dir.rename
    if not undone:

        def failing_back(self, old, new):
            if old == "iter_0000020":
                raise OSError(errno.EIO, os.strerror(errno.EIO), old)
            return rename(self, old, new)

        monkeypatch.setattr(Dir, "rename", failing_back)

    def publish():
        with Dir.open(root) as rootd:
            return publish_step(
                rootd, 20, "iter_0000020.abc-1.tmp", replaced=False, fsync=False, opener=opener, megatron_tracker=False
            )

    if undone:
        with pytest.raises(OSError):
            publish()
        assert (root / "latest").read_text() == "iter_0000010\n"
        assert not (root / "iter_0000020").exists() and (root / "iter_0000020.abc-1.tmp").is_dir()
        return
    warning = publish()
    assert (root / "latest").read_text() == "iter_0000010\n"
    assert warning is not None and "is committed, complete and in place" in warning and "daemon start" in warning
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) == "iter_0000020"


def test_a_replacing_commit_whose_rename_fails_puts_the_replaced_checkpoint_back(tmp_path, monkeypatch):
    """A re-save of step 20 after a rollback moves the old iter_0000020 aside, then renames the new
    one into place: when that rename failed, the old one stayed at its .deleting name for gc to
    remove, although a tracker (Megatron-LM's, after a rollback) may name it."""
    import errno
    import os

    from ckptd.format.durable import default_opener
    from ckptd.roots.posix import publish_step

    root = make_root(tmp_path / "r", [10, 20], latest=10)
    make_checkpoint(root / "iter_0000020.abc-1.tmp")
    rename = Dir.rename

    def failing(self, old, new):
        if old == "iter_0000020.abc-1.tmp":
            raise OSError(errno.EIO, os.strerror(errno.EIO), old)
        return rename(self, old, new)

    monkeypatch.setattr(Dir, "rename", failing)
    with Dir.open(root) as rootd, pytest.raises(OSError):
        publish_step(
            rootd,
            20,
            "iter_0000020.abc-1.tmp",
            replaced=True,
            fsync=False,
            opener=default_opener,
            megatron_tracker=False,
        )
    assert (root / "iter_0000020" / "metadata.json").is_file() and not list(root.glob("*.deleting"))


def test_verify_without_a_tracker_checks_the_checkpoint_a_resume_would_load(tmp_path):
    """No tracker after a rollback (committed 20, 30, 40, then 31): ``ckptd verify ROOT`` checked
    the highest step, the abandoned 40, and called it the newest committed checkpoint."""
    from ckptd.verifyroot import select_for_verify

    root = make_root(tmp_path / "r", [20, 30, 31, 40], latest=None)
    stamp_commits(root, [20, 30, 40, 31])
    chosen, findings = select_for_verify(scan_root(root), all_checkpoints=False)
    assert chosen == [root / "iter_0000031"]
    assert "newest committed checkpoint iter_0000031" in findings[0].message


def test_verify_holds_a_load_s_lease_so_a_collection_meanwhile_removes_nothing_it_reads(tmp_path):
    """``ckptd verify ROOT --all`` while ``ckptd gc`` runs: gc removed the checkpoint being
    verified file by file, and verify reported the missing files as damage (exit 1). Verify holds
    a load's lease now, so the removal waits for a later collection; one removed before verify
    reached it is a warning, not damage."""
    import contextlib

    from ckptd.verifyroot import verify_root

    root = make_root(tmp_path / "r", [10, 20], latest=20)

    @contextlib.contextmanager
    def collect_meanwhile(path):
        if path.name == "iter_0000010":
            plan = plan_gc(scan_root(root), keep=1)
            assert [r.entry.step for r in plan.remove] == [10]
            apply_gc(plan)
            assert any(e.step == 10 for e, _ in plan.kept)  # postponed: a load holds it
        yield None

    out = verify_root(scan_root(root), all_checkpoints=True, progress_for=collect_meanwhile)
    assert out.status == "OK" and len(out.reports) == 2, out.to_dict()
    assert (root / "iter_0000010").is_dir()
    # Removed after the scan, before verify reached it.
    cat = scan_root(root)
    apply_gc(plan_gc(scan_root(root), keep=1))
    assert not (root / "iter_0000010").exists()
    out = verify_root(cat, all_checkpoints=True)
    assert out.status == "OK" and [r.checkpoint for r in out.reports] == [str(root / "iter_0000020")]
    assert any("was removed" in f.message and f.severity == "warning" for f in out.findings), out.findings


def test_gc_keeps_the_newest_loadable_checkpoint_when_the_newer_ones_kept_are_damaged(tmp_path):
    """The tracker names 40, which lost a data file; ``ckptd gc --keep 1`` kept the broken 40 and
    removed 20 and 30, the only loadable checkpoints."""
    from ckptd.recovery import structural_problem

    root = make_root(tmp_path / "r", [20, 30, 40], latest=40)
    stamp_commits(root, [20, 30, 40])
    for f in (root / "iter_0000040").glob("*.distcp"):
        f.unlink()
    plan = plan_gc(scan_root(root), keep=1, intact=lambda e: structural_problem(e.path) is None)
    assert [r.entry.step for r in plan.remove] == [20]
    assert any(e.step == 30 and "newest loadable" in why for e, why in plan.kept), plan.kept
    # Intact: nothing more is asked than the latest, and keep decides as before.
    asked = []
    plan = plan_gc(
        scan_root(make_root(tmp_path / "ok", [20, 30], latest=30)),
        keep=1,
        intact=lambda e: asked.append(e.step) or True,
    )
    assert [r.entry.step for r in plan.remove] == [20] and asked == [30]


def test_gc_of_a_ckptd_root_that_lost_its_tracker_removes_nothing_committed(tmp_path):
    """Committed 20, 30, 40, then (a rollback) 31; the tracker is gone. gc went by commit order and
    removed 20, on the branch the job trains on, keeping the abandoned 40. A root ckptd committed
    to always has one: without it nothing committed is removed (as with an untrusted tracker)."""
    root = make_root(tmp_path / "r", [20, 30, 31, 40], latest=None)
    stamp_commits(root, [20, 30, 40, 31])
    plan = plan_gc(scan_root(root), keep=3)
    assert plan.remove == [] and "no 'latest' tracker" in plan.refused
    assert "the newest commit is iter_0000031" in plan.refused  # what to write into it
    # Megatron-LM's tracker names the branch instead (as in a root without ckptd's): gc goes by it.
    (root / "latest_checkpointed_iteration.txt").write_text("31")
    plan = plan_gc(scan_root(root), keep=3)
    assert plan.refused is None and 31 not in [r.entry.step for r in plan.remove]


def test_a_coordinator_start_leaves_a_tracker_set_back_by_hand(tmp_path):
    """An operator rolls back by rewriting the tracker (Megatron-LM users do): 40 -> 20. The next
    daemon start took it for an interrupted commit and named 40 again, so the job resumed 40. A
    tracker one commit behind the newest is still taken for an interrupted commit."""
    root = make_root(tmp_path / "r", [20, 30, 40], latest=20)
    stamp_commits(root, [20, 30, 40])
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) is None
    assert (root / "latest").read_text() == "iter_0000020\n"
    (root / "latest").write_text("iter_0000030\n")  # one behind: the commit of 40 was interrupted
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) == "iter_0000040"
    # Two behind but written before the newest commit (30's tracker write had failed and could not
    # be taken back, then 40's commit was interrupted): an interrupted commit, finished.
    (root / "latest").write_text("iter_0000020\n")
    os.utime(root / "latest", (1.0e9 + 1.5, 1.0e9 + 1.5))  # after 20's commit, before 30's and 40's
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) == "iter_0000040"


def test_a_removal_postponed_for_an_unreadable_commit_record_says_so(tmp_path):
    root = make_root(tmp_path / "r", [10, 20], latest=20)
    stamp_commits(root, [10, 20])
    plan = plan_gc(scan_root(root), keep=1)
    (root / "iter_0000010" / "ckptd_commit.json").write_text("{not json")
    apply_gc(plan)
    assert (root / "iter_0000010").is_dir()
    assert any(e.step == 10 and "cannot be read any more" in why for e, why in plan.kept), plan.kept


def test_a_job_that_went_back_replaces_only_the_steps_it_left_committed_before_it_did(tmp_path):
    from ckptd.catalog import WentBack

    root = make_root(tmp_path / "r", [10, 20, 30, 40], latest=40)
    stamp_commits(root, [10, 20, 30, 40])  # committed at 1e9 + 1 ... 1e9 + 4
    cat = scan_root(root)
    back = WentBack(step=20, before_unix_s=1.0e9 + 10)
    assert cat.superseded(30, back).step == 30
    # Not 40 while the left 30 lies between: the new 40 would leave it passing for its ancestor.
    assert cat.superseded(40, back) is None and cat.left_between(40, back) == ["iter_0000030"]
    assert cat.superseded(20, back) is None and cat.superseded(10, back) is None  # not left
    assert cat.superseded(40, WentBack(step=20, before_unix_s=1.0e9 + 3.5)) is None  # committed after it loaded
    assert cat.superseded(30, None) is None  # a step is committed once
    assert not committed_once(root, 30, back) and committed_once(root, 30)
    # A remembered verdict of the left commit does not answer for the new save of its step.
    from ckptd.roots.posix_root import PosixRoot

    store = PosixRoot(root, fsync=False)
    assert store.holds_commit(30, "0123456789ab-1") and not store.holds_commit(30, "0123456789ab-1", back)


@pytest.mark.parametrize("damage", ["intact", "lost data file", "lost markers", "another tool's, damaged"])
def test_only_a_commit_of_ckptd_s_that_lost_files_is_replaced_by_a_save_of_its_step(tmp_path, damage):
    """The coordinator's check before a save replaces a committed step (ckptd.roots.posix.damaged_commit):
    a checkpoint another tool wrote (no commit record), which ckptd may merely be unable to read,
    is never replaced; one that lost its markers (no longer "committed" to a scan) is."""
    from ckptd.roots.posix import damaged_commit

    root = make_root(tmp_path / "r", [10, 20], latest=20)
    if damage != "another tool's, damaged":
        stamp_commits(root, [10, 20])
    step_dir = root / "iter_0000020"
    if damage in ("lost data file", "another tool's, damaged"):
        next(step_dir.glob("*.distcp")).unlink()
    elif damage == "lost markers":
        (step_dir / "metadata.json").unlink()
        (step_dir / ".metadata").unlink()
    entry, why = damaged_commit(scan_root(root), "iter_0000020", step_dir)
    if damage in ("intact", "another tool's, damaged"):
        assert (entry, why) == (None, None)
    else:
        assert entry is not None and entry.step == 20 and why, why


def test_a_checkpoint_another_tool_wrote_is_never_taken_for_one_a_job_left(tmp_path):
    """A resume passed over a step ckptd cannot read (an intact Megatron-Core zarr checkpoint, no
    commit record): the job's save of that step replaced it (deleted it)."""
    from ckptd.catalog import WentBack

    root = make_root(tmp_path / "r", [100, 200], latest=None)  # no commit records: not ckptd's
    back = WentBack(step=100, before_unix_s=time.time())
    assert scan_root(root).superseded(200, back) is None and committed_once(root, 200, back)


def test_a_load_of_an_older_step_first_lets_the_saves_above_it_land_for_a_while():
    from ckptd.client.pending import settle_above

    waited = []

    class Future:
        def __init__(self, step: int) -> None:
            self.step = step

        def wait(self, timeout_s: float) -> None:  # the handle's wait would mark a failure observed
            waited.append((self.step, timeout_s > 0))

    class Handle:
        def __init__(self, step: int, fails: bool = False) -> None:
            self.step, self.future = step, Future(step)

        def wait(self, timeout_s: float) -> None:
            raise AssertionError("a handle's wait marks its failure observed: never raised again")

    settle_above([Handle(10), Handle(30, fails=True), Handle(40)], 20, 5.0)  # type: ignore[list-item]
    assert waited == [(30, True), (40, True)]


def test_retention_on_a_node_local_disk_keeps_the_new_numbering_after_node_0_was_replaced():
    """Node 0's disk was replaced: its commits are numbered from 1 again, and retention on node 1
    ranked the old disk's commits (seq 48-50) above the new ones, removing 110 (seq 1), which the
    job trains on, and keeping 80-100, of which node 0 holds no files."""
    from pathlib import Path

    from ckptd.catalog import CheckpointEntry, DirUsage, RootCatalog

    def entry(step: int, seq: int, latest: bool = False, at: float | None = None) -> CheckpointEntry:
        name = step_dir_name(step)
        return CheckpointEntry(
            name=name,
            path=Path("/node1") / name,
            step=step,
            state=EntryState.COMMITTED,
            usage=DirUsage(0, 0, 0.0),
            is_latest=latest,
            commit_seq=seq,
            committed_unix_s=at if at is not None else 1000.0 + 60 * seq,
        )

    # The old disk's 80-100 (seq 48-50, committed before the replacement at t=1e6), the new disk's
    # 110 and 120 (seq 1, 2).
    old = [entry(80, 48), entry(90, 49), entry(100, 50)]
    entries = [*old, entry(110, 1, at=1e6), entry(120, 2, latest=True, at=1e6 + 600)]
    cat = RootCatalog(Path("/node1"), entries=entries, tracker_exists=True, latest_name=step_dir_name(120))
    cat.node_local = True
    plan = plan_gc(cat, keep=2)
    assert sorted(r.entry.step for r in plan.remove) == [80, 90, 100]
    assert sorted(e.step for e, _ in plan.kept) == [110, 120]
    # One numbering: a commit the tracker has not caught up with (a rollback's 60, renamed into
    # place before its daemon died) has a higher number and a later time: the newest, kept.
    entries = [entry(80, 8), entry(90, 9), entry(100, 10), entry(110, 11, latest=True), entry(60, 12)]
    cat = RootCatalog(Path("/node1"), entries=entries, tracker_exists=True, latest_name=step_dir_name(110))
    cat.node_local = True
    assert sorted(e.step for e, _ in plan_gc(cat, keep=2).kept) == [60, 110]


def test_gc_keeps_a_newer_checkpoint_another_tool_saved_into_a_ckptd_root(tmp_path):
    """ckptd committed 100 (its tracker names it); then Megatron-LM's own saver (or ckptd.save)
    wrote 200 there, without a commit record, and Megatron-LM's tracker names 200. gc took 200 for
    a step a rollback left (no record: number 0, below the tracker's) and removed the checkpoint
    Megatron-LM resumes."""
    from ckptd.format.rootlayout import MEGATRON_TRACKER

    root = make_root(tmp_path / "run", [50, 100, 200], latest=100)
    stamp_commits(root, [50, 100])  # 200 has no commit record
    (root / MEGATRON_TRACKER).write_text("200")
    cat = scan_root(root)
    assert cat.megatron_latest_name == step_dir_name(200) and not cat.off_branch()
    plan = plan_gc(cat, keep=1)
    assert [r.entry.step for r in plan.remove] == [50]
    assert {e.step for e, _ in plan.kept} == {100, 200}


def test_only_the_names_ckptd_and_megatron_give_are_steps(tmp_path):
    """A hand-made iter_100 (or iter_ and non-ASCII digits, or a name ending in a newline) passed
    for step 100: a resume could load it, and retention removed it."""
    root = make_root(tmp_path / "r", [10, 20], latest=20)
    for name in ("iter_100", "iter_\u0661\u0660\u0660\u0660\u0660\u0660\u0660", "iter_0000100\n", "iter_00000100"):
        make_checkpoint(root / name, step=100)
    cat = scan_root(root)
    assert sorted(e.step for e in cat.entries) == [10, 20]
    plan = plan_gc(cat, keep=1)
    assert [r.entry.step for r in plan.remove] == [10]
    assert apply_gc(plan) == [(plan.remove[0], None)]
    odd = {"iter_100", "iter_\u0661\u0660\u0660\u0660\u0660\u0660\u0660", "iter_0000100\n", "iter_00000100"}
    assert odd | {"iter_0000020"} == {n for n in os.listdir(root) if n.startswith("iter_")}
