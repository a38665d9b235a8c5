"""Issue 25 H2: a job that goes back to an earlier step (a loss spike: load step 30, train on)
keeps what it commits from then on, and a restart resumes the new branch, not the abandoned one.
Real daemon, real files, a single process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.format.commitrecord import read_commit_record
from ckptd.format.rootlayout import step_dir_name


def _sd(w: torch.Tensor, step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w), "iteration": step}


def _config(runtime_dir: Path, keep_last: int) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), keep_last=keep_last, idle_exit_s=2.0, heartbeat_s=0.2
    )


def _value(step: int, branch: int) -> torch.Tensor:
    return torch.full((64,), float(step * 10 + branch))


def _commit_then_go_back(ckpt: ckptd.Checkpointer, step: int) -> None:
    """Commit steps 10-40 of branch 0, then load ``step`` of them (going back), checked."""
    for s in (10, 20, 30, 40):
        ckpt.save(_sd(_value(s, 0), s), step=s).wait(timeout_s=30)
    w = torch.zeros(64)
    ckpt.load(_sd(w, -1), step=step)
    assert torch.equal(w, _value(step, 0))


def _steps(root) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_") and "." not in p.name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keep_last", [2, 3])
def test_rollback_keeps_the_new_branch_and_resumes_it(tmp_path, single_process, keep_last, runtime_dir):
    root = tmp_path / "run"
    cfg = _config(runtime_dir, keep_last)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        # A loss spike: go back to step 30 and train on from there.
        _commit_then_go_back(ckpt, 30)
        handles = {}
        for step in (31, 32, 33):
            handles[step] = ckpt.save(_sd(_value(step, 1), step), step=step)
            handles[step].wait(timeout_s=30)
            assert (root / step_dir_name(step)).is_dir(), f"step {step} committed and then deleted"
            assert ckpt.latest() == step
        assert any("older than committed steps (40)" in w for w in handles[31].warnings)
        assert not handles[32].warnings
    # Retention keeps the last keep_last commits, in commit order: the abandoned step 40 goes
    # once keep_last newer commits exist.
    assert _steps(root) == [31, 32, 33][-keep_last:]
    with ckptd.Checkpointer(root, config=cfg) as ckpt:  # a restart resumes the new branch
        assert ckpt.latest() == 33
        w = torch.zeros(64)
        assert ckpt.load(_sd(w, -1))["iteration"] == 33 and torch.equal(w, _value(33, 1))


def _abandon_step_20(ckpt: ckptd.Checkpointer) -> None:
    """Commit 10 and 20, go back to 10 and commit 11: step 20 is on an abandoned branch."""
    for step in (10, 20):
        ckpt.save(_sd(_value(step, 0), step), step=step).wait(timeout_s=30)
    ckpt.load(_sd(torch.zeros(64), -1), step=10)
    ckpt.save(_sd(_value(11, 1), 11), step=11).wait(timeout_s=30)


@pytest.mark.timeout(120)
def test_a_save_of_an_abandoned_step_replaces_it(tmp_path, single_process, runtime_dir):
    root = tmp_path / "run"
    with ckptd.Checkpointer(root, config=_config(runtime_dir, 10)) as ckpt:
        _abandon_step_20(ckpt)
        # Step 20 of the abandoned branch is still there; the new branch reaches step 20 again.
        assert _steps(root) == [10, 11, 20]
        h = ckpt.save(_sd(_value(20, 1), 20), step=20)
        h.wait(timeout_s=30)
        assert any("abandoned by an earlier rollback was replaced by this save" in w for w in h.warnings)
        assert ckpt.latest() == 20
        w = torch.zeros(64)
        ckpt.load(_sd(w, -1))
        assert torch.equal(w, _value(20, 1))
        # Step 20 of the current branch is committed once: saving it again is refused.
        with pytest.raises(ckptd.CheckpointExistsError, match="committed already"):
            ckpt.save(_sd(_value(20, 1), 20), step=20)
    seqs = {s: read_commit_record(root / step_dir_name(s)).seq for s in _steps(root)}
    assert seqs[10] < seqs[11] < seqs[20]
    assert not [p.name for p in root.iterdir() if p.name.endswith((".deleting", ".tmp"))]


@pytest.mark.timeout(120)
def test_a_new_checkpointer_re_saving_an_abandoned_step_under_the_same_attempt_id_commits_it(
    tmp_path, single_process, runtime_dir
):
    """CKPTD_RUN_ID fixes the incarnation, so a second Checkpointer of the launch names its first
    save of a step as the first did (``<tag>-1``). After a rollback, its save of the abandoned step
    20 carries the attempt id of the abandoned commit, which the coordinator (same daemon) still
    remembers as committed: that memory must not answer for the new save (it did: the ranks were
    told COMMITTED and the new save's files were removed, iter_20 kept the old branch's values)."""
    root = tmp_path / "run"
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), keep_last=10, idle_exit_s=5.0, heartbeat_s=0.2, run_id="fixed-run"
    )
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        for step in (10, 20):
            ckpt.save(_sd(_value(step, 0), step), step=step).wait(timeout_s=30)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:  # the same launch: the same incarnation
        ckpt.load(_sd(torch.zeros(64), -1), step=10)
        ckpt.save(_sd(_value(11, 1), 11), step=11).wait(timeout_s=30)
        h = ckpt.save(_sd(_value(20, 1), 20), step=20)
        h.wait(timeout_s=30)
        assert ckpt.latest() == 20
        w = torch.zeros(64)
        ckpt.load(_sd(w, -1), step=20)
        assert torch.equal(w, _value(20, 1)), "the re-save of step 20 was reported committed, but not kept"
    assert read_commit_record(root / step_dir_name(20)).seq > read_commit_record(root / step_dir_name(11)).seq


@pytest.mark.timeout(120)
def test_a_second_checkpointer_saving_a_step_under_an_attempt_id_in_flight_is_refused(
    tmp_path, single_process, runtime_dir
):
    """Two Checkpointers of one launch with a fixed CKPTD_RUN_ID name their first save of a step
    alike: while the first is still being written, the second one's was taken too, so both wrote
    one data file and were answered by one verdict (on S3 the committed step's data object could
    be replaced in place). The daemon refuses the second, naming the attempt and what to do."""
    root = tmp_path / "run"
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), idle_exit_s=5.0, heartbeat_s=0.2, run_id="fixed-run", debug_write_delay_s=2.0
    )
    with ckptd.Checkpointer(root, config=cfg) as first, ckptd.Checkpointer(root, config=cfg) as second:
        h = first.save(_sd(_value(20, 0), 20), step=20)
        with pytest.raises(ckptd.CkptdError, match=r"attempt \S+ of step 20 is already being written by another save"):
            second.save(_sd(_value(20, 1), 20), step=20).wait(timeout_s=30)
        h.wait(timeout_s=30)
        w = torch.zeros(64)
        first.load(_sd(w, -1), step=20)
        assert torch.equal(w, _value(20, 0))


@pytest.mark.timeout(120)
def test_gc_planned_before_a_re_save_of_an_abandoned_step_leaves_the_new_commit(tmp_path, single_process, runtime_dir):
    """``ckptd gc`` scans, then the job commits the abandoned step 20 again (it becomes latest),
    then gc removes what it planned: the new step 20 is kept, reported as changed (it was removed,
    and the tracker named a checkpoint that no longer existed)."""
    from ckptd.catalog import scan_root
    from ckptd.retention import apply_gc, plan_gc

    root = tmp_path / "run"
    with ckptd.Checkpointer(root, config=_config(runtime_dir, 10)) as ckpt:
        _abandon_step_20(ckpt)
        plan = plan_gc(scan_root(root), keep=1, grace_s=0.0)
        assert {r.entry.step for r in plan.remove} == {10, 20}
        ckpt.save(_sd(_value(20, 1), 20), step=20).wait(timeout_s=30)
        results = apply_gc(plan)
        assert [r.entry.step for r, err in results] == [10]
        # Kept: latest moved since the scan, so gc planned again (else: it is named latest now).
        assert any(e.step == 20 and "the tracker moved since the scan" in why for e, why in plan.kept)
        assert ckpt.latest() == 20
        w = torch.zeros(64)
        ckpt.load(_sd(w, -1))
        assert torch.equal(w, _value(20, 1))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("damage", ["bit rot", "lost data file", "intact"])
def test_a_resume_past_a_damaged_latest_can_save_its_step_again(tmp_path, single_process, runtime_dir, damage):
    """Saves every 10 steps; step 20, the latest, is damaged; a restart resumes step 10 and trains
    on to step 20, whose save was refused ("committed already") with no word of the damage: the job
    crashed there at every restart. The resume went back to step 10, so its save of 20 replaces
    the damaged one; after a resume of an intact 20, a save of 20 is refused as before."""
    from ckptd.format.dcp_metadata import read_index
    from tests.checkpoints import flip_bit

    root = tmp_path / "run"
    cfg = _config(runtime_dir, keep_last=5)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        for step in (10, 20):
            ckpt.save(_sd(_value(step, 0), step), step=step).wait(timeout_s=30)
    chunk = read_index(root / step_dir_name(20)).tensors["w"].chunks[0]
    if damage == "bit rot":
        flip_bit(root / step_dir_name(20) / chunk.relative_path, chunk.file_offset + chunk.length - 100)
    elif damage == "lost data file":
        (root / step_dir_name(20) / chunk.relative_path).unlink()
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        w = torch.zeros(64)
        ckpt.load(_sd(w, -1))
        if damage == "intact":
            assert torch.equal(w, _value(20, 0))
            with pytest.raises(ckptd.CheckpointExistsError, match="committed already"):
                ckpt.save(_sd(_value(20, 1), 20), step=20)
            return
        assert torch.equal(w, _value(10, 0))  # fell back past the damaged 20
        handle = ckpt.save(_sd(_value(20, 1), 20), step=20)
        handle.wait(timeout_s=60)
        assert any("committed before the job loaded step 10, was replaced" in t for t in handle.warnings), (
            handle.warnings
        )
        assert ckpt.latest() == 20
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        w = torch.zeros(64)
        ckpt.load(_sd(w, -1))
        assert torch.equal(w, _value(20, 1))
    assert _steps(root) == [10, 20]


@pytest.mark.timeout(180)
def test_a_rollback_saves_again_at_the_steps_it_left(tmp_path, single_process, runtime_dir):
    """Saves every 10 steps; a loss spike: go back to step 20 and train on, saving every 10 steps
    as before. The save of step 30 was refused ("committed already": the old 30 is an ancestor of
    the latest, 40), so a rollback worked only if its first save fell on a step the old branch
    lacked. A job that went back replaces the steps it left, committed before it went back."""
    root = tmp_path / "run"
    cfg = _config(runtime_dir, keep_last=10)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        _commit_then_go_back(ckpt, 20)
        with pytest.raises(ckptd.CheckpointExistsError, match="committed already"):
            ckpt.save(_sd(_value(20, 1), 20), step=20)  # the step it went back to is not left
        # 40 first: the left 30 lies between, and would pass for the new 40's ancestor.
        with pytest.raises(ckptd.CheckpointExistsError, match=r"loaded step 20 \(it went back\), but iter_0000030"):
            ckpt.save(_sd(_value(40, 1), 40), step=40)
        first = ckpt.save(_sd(_value(30, 1), 30), step=30)
        first.wait(timeout_s=30)
        assert any("committed before the job loaded step 20, was replaced" in t for t in first.warnings), first.warnings
        assert any("older than committed steps (40)" in t for t in first.warnings), first.warnings
        assert ckpt.latest() == 30
        second = ckpt.save(_sd(_value(40, 1), 40), step=40)
        second.wait(timeout_s=30)
        assert ckpt.latest() == 40
        with pytest.raises(ckptd.CheckpointExistsError, match="committed already"):
            ckpt.save(_sd(_value(30, 2), 30), step=30)  # the new branch's 30: committed once
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        w = torch.zeros(64)
        assert ckpt.load(_sd(w, -1))["iteration"] == 40 and torch.equal(w, _value(40, 1))
        ckpt.load(_sd(w, -1), step=30)
        assert torch.equal(w, _value(30, 1))
    assert _steps(root) == [10, 20, 30, 40]


@pytest.mark.timeout(120)
def test_a_resume_in_the_middle_of_a_run_resumes_the_save_in_flight(tmp_path, single_process, runtime_dir):
    """A resume while this Checkpointer's save of 20 was still being written loaded 10; 20 then
    committed above the step loaded, so the job's own save of 20 was refused as committed after
    its load. It lets its saves in flight land first now, and resumes 20."""
    root = tmp_path / "run"
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), idle_exit_s=5.0, heartbeat_s=0.2, debug_write_delay_s=1.5
    )
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        ckpt.save(_sd(_value(10, 0), 10), step=10).wait(timeout_s=30)
        h = ckpt.save(_sd(_value(20, 0), 20), step=20)
        w = torch.zeros(64)
        out = ckpt.resume(_sd(w, -1))
        assert h.done() and out["iteration"] == 20 and torch.equal(w, _value(20, 0))
        ckpt.save(_sd(_value(30, 0), 30), step=30).wait(timeout_s=30)
        assert ckpt.latest() == 30
