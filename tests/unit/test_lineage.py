"""Which branch a commit is on after rollbacks (ckptd.lineage): the parent a commit records, the
walk from the tracker's target, and what retention and a fallback make of it in a real root.
Pure logic, and real files in one process."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptd.catalog import scan_root
from ckptd.errors import CorruptCheckpointError
from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord, parse_commit_record_checked
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.lineage import WentBack, ancestry, copy_parent, loads_agree, off_lineage, parent_of
from ckptd.recovery import resolve_latest
from ckptd.retention import plan_gc
from tests.checkpoints import make_checkpoint


@dataclass(frozen=True)
class C:
    """A commit as the lineage functions see it."""

    commit_seq: int
    step: int
    parent_seq: int | None = None
    committed_unix_s: float = 0.0


def _left(target: C, commits: list[C]) -> list[int]:
    return sorted(c.step for c in off_lineage(target, commits))


# save 10, 20, 30, 40; load 20; save 25, 35, 45, 55 (the review's case)
BRANCHED = [C(1, 10), C(2, 20, 1), C(3, 30, 2), C(4, 40, 3), C(5, 25, 2), C(6, 35, 5), C(7, 45, 6), C(8, 55, 7)]


def test_the_branch_left_stays_left_once_the_new_branch_passes_its_steps():
    by_step = {c.step: c for c in BRANCHED}
    assert ancestry(by_step[55], BRANCHED).chain == {8, 7, 6, 5, 2, 1}
    assert _left(by_step[55], BRANCHED) == [30, 40]
    assert _left(by_step[35], BRANCHED) == [30, 40]
    assert _left(by_step[25], BRANCHED) == [30, 40]
    assert _left(by_step[40], BRANCHED) == []  # before the rollback nothing is left


def test_went_back_to_a_step_below_the_branch_left_and_saved_above_it():
    # save 20, 30, 40; load 30; save 50: 40 is left, 30 (50's parent) and 20 are not.
    commits = [C(1, 20), C(2, 30, 1), C(3, 40, 2), C(4, 50, 2)]
    assert _left(commits[-1], commits) == [40]


def test_records_without_parents_keep_the_older_rule():
    # Written before records named parents: a higher step committed before the target is left.
    old = [C(1, 10), C(2, 20), C(3, 30), C(4, 40), C(5, 25)]
    assert _left(old[-1], old) == [30, 40]
    # A new commit on top of an old root: its chain ends at 25, below which the older rule holds.
    newer = [*old, C(6, 35, 5)]
    assert _left(newer[-1], newer) == [30, 40]
    # The old root had no rollback; a rollback after the upgrade leaves what the lineage says.
    plain = [C(1, 10), C(2, 20), C(3, 30), C(4, 40), C(5, 45, 2)]
    assert _left(plain[-1], plain) == [30, 40]


def test_a_parent_removed_since_leaves_what_came_after_it_and_judges_the_rest_by_the_older_rule():
    # 20 (seq 2) is gone (removed by hand): 30 and 40, committed after it, are on no chain
    # through it; 10, committed before, is below 25 and stays.
    commits = [C(1, 10), C(3, 30, 2), C(4, 40, 3), C(5, 25, 2), C(6, 35, 5)]
    assert _left(commits[-1], commits) == [30, 40]


def test_a_link_a_commit_never_writes_is_not_followed():
    # A parent of a higher step (or a later commit) is no link: the older rule from the child on.
    commits = [C(1, 10), C(2, 40, 1), C(3, 30, 2)]
    assert ancestry(commits[-1], commits).chain == {3}
    assert _left(commits[-1], commits) == [40]
    looped = [C(1, 10, 2), C(2, 20, 1)]
    assert ancestry(looped[-1], looped).chain == {2, 1}


def test_above_the_target_the_lineage_says_what_the_older_rule_says():
    # Save of a step the new branch reaches again (replacing one it left) relies on this.
    for target in BRANCHED:
        left = {c.step for c in off_lineage(target, BRANCHED)}
        older = {c.step for c in BRANCHED if c.step > target.step and c.commit_seq < target.commit_seq}
        assert {s for s in left if s > target.step} == older


def test_the_parent_of_a_commit_is_what_the_job_loaded_or_committed_since():
    t = 1000.0
    commits = [C(1, 20, None, t), C(2, 30, 1, t + 1), C(3, 40, 2, t + 2)]
    went_back = WentBack(step=30, before_unix_s=t + 10)
    assert parent_of(commits, 50, None, agreed=True) == 3  # no load: the newest commit
    assert parent_of(commits, 50, went_back, agreed=True) == 2  # the step it loaded, not the newer 40
    since = [*commits, C(4, 50, 2, t + 20)]
    assert parent_of(since, 60, went_back, agreed=True) == 4  # then its own branch's newest
    assert parent_of(commits, 50, went_back, agreed=False) is None  # the ranks loaded different steps
    gone = [commits[0], commits[2]]
    assert parent_of(gone, 50, went_back, agreed=True) is None  # the loaded commit is not here
    assert parent_of(commits, 35, None, agreed=True) is None  # a lower step than the newest: unknown
    assert parent_of([], 10, None, agreed=True) is None  # the first commit
    # The loaded step committed after the load (a re-save) is not what the job loaded.
    assert parent_of([C(1, 30, None, t + 20)], 50, went_back, agreed=True) is None


def test_ranks_agree_on_what_they_loaded_also_when_none_did():
    assert loads_agree([(-1, 0.0), (-1, 0.0)])
    assert loads_agree([(30, 1.0), (30, 2.0)])
    assert not loads_agree([(30, 1.0), (-1, 0.0)])
    assert not loads_agree([])


def test_a_mirror_copy_descends_from_the_newest_copy_of_an_ancestor():
    a = "0123456789ab-1"
    copies = [(1, (11, a), 20), (2, (12, a), 30), (3, (13, a), 40)]  # (mirror seq, local (seq, attempt), step)
    assert copy_parent(copies, frozenset({(14, a), (12, a), (11, a)}), 50) == 2  # local 50 descends from 30, not 40
    assert copy_parent(copies, frozenset({(14, a), (11, a)}), 50) == 1  # 30 was never copied: 20's copy
    assert copy_parent(copies, frozenset({(14, a)}), 50) is None


def test_a_lost_local_root_begun_again_does_not_take_an_old_runs_copy_for_an_ancestor():
    """A local root lost and begun again numbers its commits from 1 again: the mirror's copy of
    its first commit (seq 1, another attempt) descends from no copy of the old run's seq 1, which
    would have made every later copy of the old run pass for a left branch."""
    old, new = "0123456789ab-1", "ba9876543210-1"
    copies = [(1, (1, old), 10), (2, (2, old), 20), (3, (3, old), 30)]
    assert copy_parent(copies, frozenset({(1, new)}), 60) is None
    assert copy_parent([*copies, (4, (1, new), 60)], frozenset({(2, new), (1, new)}), 70) == 4


def test_parent_seq_round_trips_and_a_damaged_one_is_refused():
    rec = CommitRecord(seq=5, step=50, attempt="0123456789ab-1", committed_unix_s=1.0, parent_seq=2)
    assert parse_commit_record_checked(rec.to_bytes(), "x") == rec
    assert b"parent_seq" not in CommitRecord(seq=5, step=50, attempt="a", committed_unix_s=1.0).to_bytes()
    for bad in (0, 5, 6, "2", 2.0):
        raw = json.dumps({**json.loads(rec.to_bytes()), "parent_seq": bad}).encode()
        with pytest.raises(CorruptCheckpointError, match="damaged"):
            parse_commit_record_checked(raw, "x")


def _root(tmp_path: Path, commits: list[tuple[int, int | None]], latest: int) -> Path:
    """A root of real checkpoints committed in the order ``commits`` lists them: (step, the step
    of the parent, or None), the tracker naming ``latest``."""
    root = tmp_path / "root"
    root.mkdir()
    seqs: dict[int, int] = {}
    for seq, (step, parent) in enumerate(commits, start=1):
        make_checkpoint(root / step_dir_name(step), step=step)
        seqs[step] = seq
        rec = CommitRecord(
            seq=seq,
            step=step,
            attempt="0123456789ab-1",
            committed_unix_s=1.0e9 + seq,
            parent_seq=None if parent is None else seqs[parent],
        )
        (root / step_dir_name(step) / COMMIT_RECORD).write_bytes(rec.to_bytes())
    (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(latest)))
    return root


REVIEWED = [(10, None), (20, 10), (30, 20), (40, 30), (25, 20), (35, 25), (45, 35), (55, 45)]


def test_retention_keeps_the_step_gone_back_to_over_the_branch_left(tmp_path):
    cat = scan_root(_root(tmp_path, REVIEWED, 55), usage=False)
    assert sorted(e.step for e in cat.off_branch()) == [30, 40]
    assert [e.step for e in cat.branch_first] == [55, 45, 35, 25, 20, 10, 40, 30]
    plan = plan_gc(cat, 5, grace_s=0.0)
    # The five last commits of the branch the job trains on, 20 (the step it went back to) among
    # them; before, the new branch passing 30 and 40 made them pass for its ancestors, and 20 went.
    assert sorted(e.step for e, _ in plan.kept) == [20, 25, 35, 45, 55]
    reasons = {r.entry.step: r.reason for r in plan.remove}
    assert sorted(reasons) == [10, 30, 40]
    assert "on a branch a rollback abandoned" in reasons[30] and "on a branch" in reasons[40]


def test_a_fallback_keeps_to_the_branch_and_takes_the_one_left_only_when_nothing_else_is_left(tmp_path):
    root = _root(tmp_path, [(20, None), (30, 20), (40, 30), (50, 30)], 50)
    (root / step_dir_name(50) / "__0_0.distcp").unlink()
    choice = resolve_latest(root)
    assert choice is not None and choice.entry.step == 30 and "abandoned" not in (choice.fallback_reason or "")
    for step in (30, 20):
        (root / step_dir_name(step) / "__1_0.distcp").unlink()
    choice = resolve_latest(root)
    assert choice is not None and choice.entry.step == 40
    assert "no checkpoint of its branch is loadable" in (choice.fallback_reason or "")
    assert "on a branch a rollback abandoned" in (choice.fallback_reason or "")
