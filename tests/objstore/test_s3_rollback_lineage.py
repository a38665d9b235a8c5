"""After a rollback the branch the job left stays left once the new branch's steps pass its steps,
on an ``s3://`` root and in a mirror's copies (ckptd.lineage), against a real server (SeaweedFS)."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckptd
from ckptd.catalog import scan_root
from ckptd.roots.mirror import local_latest, mirror_step
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import read_s3_commit_record, scan_s3_root
from ckptd.storage.url import S3Location, parse_location
from tests.objstore.test_s3_roots import _config, _sd
from tools.harness.daemons import stop_root_daemons


def _value(step: int) -> torch.Tensor:
    return torch.full((64,), float(step))


def _go_back_to_30_and_save_50(ckpt: ckptd.Checkpointer) -> None:
    """Save 20, 30 and 40, go back to 30 (a load), save 50: its handle says 40 is left behind."""
    for step in (20, 30, 40):
        ckpt.save(_sd(_value(step), step), step=step).wait(timeout_s=120)
    w = torch.zeros(64)
    ckpt.load(_sd(w, -1), step=30)
    assert torch.equal(w, _value(30))
    h = ckpt.save(_sd(_value(50), 50), step=50)
    h.wait(timeout_s=120)
    assert any("iter_0000040 is on the branch it left" in t for t in h.warnings), h.warnings


@pytest.mark.timeout(240)
def test_a_rollback_on_s3_saving_above_the_left_step_keeps_the_step_it_went_back_to(s3_bucket, runtime_dir):
    """keep_last=2: save 20, 30, 40, go back to 30, save 50: before, 40 passed for 50's parent and
    the store's retention removed 30, the step the job went back to."""
    root = f"s3://{s3_bucket}/runs/lineage"
    location = parse_location(root)
    assert isinstance(location, S3Location)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=2)) as ckpt:
            _go_back_to_30_and_save_50(ckpt)
            assert ckpt.latest() == 50
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    cat = scan_s3_root(location, usage=False)
    assert sorted(e.step for e in cat.committed) == [30, 50]
    seqs = {e.step: e.commit_seq for e in cat.committed}
    assert next(e for e in cat.committed if e.step == 50).parent_seq == seqs[30]


@pytest.mark.timeout(240)
def test_a_mirrors_copies_keep_to_the_branch_the_local_root_trains_on(s3_bucket, runtime_dir, tmp_path):
    """The mirror copies the local commits 20, 30, 40, then, after the job went back to 30, 50:
    the copy of 50 descends from the copy of 30, so the mirror's retention (keep_last=2) keeps 30,
    not the left 40 (before, 40 passed for 50's parent there too)."""
    local = tmp_path / "local"
    store = S3Root(parse_location(f"s3://{s3_bucket}/mirror/lineage"), keep_last=2)  # type: ignore[arg-type]
    try:
        with ckptd.Checkpointer(local, config=_config(runtime_dir)) as ckpt:  # copies made by hand below
            for step in (20, 30, 40):
                ckpt.save(_sd(_value(step), step), step=step).wait(timeout_s=60)
                commit = local_latest(local)
                assert commit is not None
                mirror_step(local, commit, store)
            ckpt.load(_sd(torch.zeros(64), -1), step=30)
            ckpt.save(_sd(_value(50), 50), step=50).wait(timeout_s=60)
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    commit = local_latest(local)
    assert commit is not None and commit.step == 50
    mirror_step(local, commit, store)
    cat = scan_s3_root(store.location, usage=False)
    assert sorted(e.step for e in cat.committed) == [30, 50]
    copy_of_30 = next(e for e in cat.committed if e.step == 30)
    record = read_s3_commit_record(store.client, "iter_0000050")
    assert record is not None and record.parent_seq == copy_of_30.commit_seq


@pytest.mark.timeout(240)
def test_a_rollback_on_node_local_disks_records_the_step_it_went_back_to(s3_bucket, runtime_dir, tmp_path):
    """Node-local disks (a mirror behind them): save 20, 30, 40, go back to 30, save 50. The
    ranks said nothing of the step they loaded there (no step is replaced on node-local disks), so
    50's commit descended from 40 there too; it descends from 30, and 40 is on the branch left."""
    root = tmp_path / "node0"
    cfg = _config(runtime_dir, mirror=f"s3://{s3_bucket}/m", node_local=True)
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            _go_back_to_30_and_save_50(ckpt)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    cat = scan_root(root, usage=False)
    seqs = {e.step: e for e in cat.committed}
    assert seqs[50].parent_seq == seqs[30].commit_seq
    assert [e.step for e in cat.off_branch()] == [40]


@pytest.mark.timeout(300)
def test_a_lost_local_root_begun_again_leaves_the_mirrors_copies_on_the_branch(s3_bucket, runtime_dir, tmp_path):
    """The local root is lost (a scratch purge, a replaced disk) and the job resumes from the
    mirror: the new local root numbers its commits from 1 again. The mirror's copy of that first
    commit took the old run's copy of local seq 1 (step 10) for its parent, so every later copy
    of the old run (50 included, the one the job resumed from) passed for a left branch:
    retention kept step 10 over them, and a fallback resumed step 10. Copies now name the local
    commit by number and attempt."""
    local = tmp_path / "local"
    mirror = f"s3://{s3_bucket}/mirror/lost"
    cfg = _config(runtime_dir, keep_last=0, mirror=mirror, mirror_keep_last=0)
    try:
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            for step in (10, 20, 30, 40, 50):
                ckpt.save(_sd(_value(step), step), step=step).wait(timeout_s=120)
                ckpt.wait_mirrored(step, timeout_s=120)
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    shutil.rmtree(local)
    try:
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            assert ckpt.load(_sd(torch.zeros(64), -1))["iteration"] == 50
            for step in (60, 70):
                ckpt.save(_sd(_value(step), step), step=step).wait(timeout_s=120)
                ckpt.wait_mirrored(step, timeout_s=120)
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    cat = scan_s3_root(parse_location(mirror), usage=False)
    assert cat.off_branch() == []
    assert [e.name for e in cat.branch_first][:3] == ["iter_0000070", "iter_0000060", "iter_0000050"]
