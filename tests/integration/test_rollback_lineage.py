"""After a rollback the branch the job left stays left once the new branch's steps pass its
steps: retention keeps the step the job went back to over it, and a resume past a damaged latest
falls back into the new branch first (ckptd.lineage). Real daemon, real files, a single process."""

from __future__ import annotations

import logging
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


def _value(step: int) -> torch.Tensor:
    return torch.full((64,), float(step))


def _save(ckpt: ckptd.Checkpointer, step: int) -> list[str]:
    h = ckpt.save(_sd(_value(step), step), step=step)
    h.wait(timeout_s=60)
    return list(h.warnings)


def _steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("iter_") and "." not in p.name)


def _go_back(ckpt: ckptd.Checkpointer, step: int) -> None:
    w = torch.zeros(64)
    ckpt.load(_sd(w, -1), step=step)
    assert torch.equal(w, _value(step))


@pytest.mark.timeout(120)
def test_retention_keeps_the_step_gone_back_to_when_the_new_branch_passes_the_left_steps(
    tmp_path, single_process, runtime_dir
):
    """keep_last=5: save 10-40, go back to 20, save 25-55. Before, once 35 and 45 passed the left
    30 and 40, those passed for the new branch's ancestors: 20, the step the job went back to,
    was removed at 55's commit and the left 30 kept."""
    root = tmp_path / "run"
    with ckptd.Checkpointer(root, config=_config(runtime_dir, 5)) as ckpt:
        for step in (10, 20, 30, 40):
            _save(ckpt, step)
        _go_back(ckpt, 20)
        listed = {}
        for step in (25, 35, 45, 55):
            _save(ckpt, step)
            listed[step] = _steps(root)
    assert listed == {
        25: [10, 20, 25, 30, 40],
        35: [10, 20, 25, 35, 40],
        45: [10, 20, 25, 35, 45],
        55: [20, 25, 35, 45, 55],
    }
    seq = {s: read_commit_record(root / step_dir_name(s)) for s in (20, 25, 35)}
    assert seq[25].parent_seq == seq[20].seq and seq[35].parent_seq == seq[25].seq


@pytest.mark.timeout(120)
def test_a_rollback_saving_above_the_left_step_keeps_the_step_it_went_back_to(tmp_path, single_process, runtime_dir):
    """keep_last=2: save 20, 30, 40, go back to 30 and save on at 50 (the bad batches skipped).
    Before, 40 passed for 50's parent and 30 was removed; nothing said the job went back."""
    root = tmp_path / "run"
    with ckptd.Checkpointer(root, config=_config(runtime_dir, 2)) as ckpt:
        for step in (20, 30, 40):
            _save(ckpt, step)
        _go_back(ckpt, 30)
        warnings = _save(ckpt, 50)
        assert ckpt.latest() == 50
    assert _steps(root) == [30, 50]
    assert any(
        "iter_0000050 continues from iter_0000030" in w and "iter_0000040 is on the branch it left" in w
        for w in warnings
    ), warnings


@pytest.mark.timeout(180)
def test_a_resume_past_a_damaged_latest_falls_back_into_the_branch_the_job_trains_on(
    tmp_path, single_process, runtime_dir, caplog
):
    """No retention: save 20, 30, 40, go back to 30, save 50; 50 loses a data file. The restart
    resumed the left 40 (the newest commit of a lower step), saying nothing of it; it resumes 30,
    and the left branch only once nothing of the job's own is loadable, saying so."""
    root = tmp_path / "run"
    cfg = _config(runtime_dir, 0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        for step in (20, 30, 40):
            _save(ckpt, step)
        _go_back(ckpt, 30)
        _save(ckpt, 50)

    def lose_data(step: int) -> None:
        for f in (root / step_dir_name(step)).glob("*.distcp"):
            f.unlink()

    def resumed() -> tuple[float, str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptd.recovery"), ckptd.Checkpointer(root, config=cfg) as ckpt:
            w = torch.zeros(64)
            ckpt.load(_sd(w, -1))
        return float(w[0]), caplog.text

    lose_data(50)
    value, log = resumed()
    assert value == 30.0 and "iter_0000030" in log and "abandoned" not in log, log
    lose_data(30)
    lose_data(20)
    value, log = resumed()
    assert value == 40.0 and "no checkpoint of its branch is loadable" in log, log
