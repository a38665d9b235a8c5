"""Guarantee 2's fallback: when the ``latest`` tracker is missing, unreadable or names a missing,
incomplete or damaged checkpoint, ``resolve_latest`` (hence ``Checkpointer.latest()`` and
``load()``) takes the newest valid committed checkpoint and logs a warning; ``*.tmp`` saves are
never candidates; a root whose checkpoints are all damaged raises instead of starting over.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import LoadMismatchError, ShardedTensor
from ckptd.client.resume import load_latest
from ckptd.errors import CorruptCheckpointError, UnknownClassError
from ckptd.format.rootlayout import MEGATRON_TRACKER, TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.recovery import resolve_latest
from tests.checkpoints import (
    FUTURE_CLASS,
    FUTURE_MODULE,
    future_writer_importable,
    make_checkpoint,
    make_root,
    rewrite_as_future_class,
    stamp_commits,
)
from tests.cli import offline_cli
from tests.fault.single_job import loads_bit_exact, single_job, state_dict, values
from tools.harness.ranks import run_ranks


def _chosen(root, caplog) -> tuple[int | None, str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptd.recovery"):
        choice = resolve_latest(root)
    return (None if choice is None else choice.step), caplog.text


def test_a_sound_tracker_is_followed_silently(tmp_path, caplog):
    root = make_root(tmp_path / "r", [1, 2, 3], latest=2)  # the tracker decides, not the newest name
    assert _chosen(root, caplog) == (2, "")


@pytest.mark.parametrize(
    "damage, why, expected",
    [
        (lambda r: (r / "latest").write_text("iter_0000009\n"), "does not exist", 3),
        (lambda r: (r / "latest").write_bytes(b"\xff\xfe\x00garbage"), "not UTF-8", 3),
        (lambda r: (r / "latest").write_text("../../etc\n"), "not a checkpoint directory name", 3),
        (lambda r: ((r / "latest").unlink(), (r / "latest").mkdir()), "cannot be read", 3),
        (lambda r: (r / "latest").unlink(), "no tracker file", 3),
        (lambda r: (r / "iter_0000003" / "metadata.json").unlink(), "commit marker is gone", 2),
        (lambda r: os.truncate(r / "iter_0000003" / "__1_0.distcp", 10), "truncated", 2),
        (lambda r: (r / "iter_0000003" / "__0_0.distcp").unlink(), "missing", 2),
        (lambda r: (r / "iter_0000003" / ".metadata").write_bytes(b"\x80\x04junk"), "cannot be decoded", 2),
        (lambda r: (r / "iter_0000003" / "common.pt").unlink(), "common.pt is missing", 2),
    ],
)
def test_a_bad_tracker_falls_back_to_the_newest_valid_checkpoint(tmp_path, caplog, damage, why, expected):
    root = make_root(tmp_path / "r", [1, 2, 3], latest=3)
    damage(root)
    step, log = _chosen(root, caplog)
    assert step == expected and why in log and "resuming from the newest valid committed checkpoint" in log, log


def test_damaged_newer_checkpoints_are_skipped_and_named(tmp_path, caplog):
    root = make_root(tmp_path / "r", [1, 2, 3, 4], latest=4)
    os.truncate(root / "iter_0000004" / "__0_0.distcp", 0)
    (root / "iter_0000003" / "common.pt").unlink()
    step, log = _chosen(root, caplog)
    assert step == 2 and "skipped damaged newer ones: iter_0000003" in log, log


def test_a_fallback_after_a_rollback_stays_on_the_branch_the_job_trains_on(tmp_path, caplog):
    """Committed 10, 20, 30, then a rollback to 10 and a save of 15, which is found damaged: the job
    resumes 10, the step it rolled back to, not 30 (committed more recently, but the branch it
    abandoned). Only when nothing of its branch is loadable does it take 30, and says so."""
    root = make_root(tmp_path / "r", [10, 15, 20, 30], latest=15)
    stamp_commits(root, [10, 20, 30, 15])
    os.truncate(root / "iter_0000015" / "__0_0.distcp", 0)
    step, log = _chosen(root, caplog)
    assert step == 10 and "resuming from the newest valid committed checkpoint iter_0000010" in log, log
    caplog.clear()
    (root / "iter_0000010" / "common.pt").unlink()
    step, log = _chosen(root, caplog)
    assert step == 30 and "on a branch a rollback abandoned" in log and "iter_0000010" in log, log
    # The tracker's target lost its markers (not only a data file): its commit record still tells
    # the branch.
    caplog.clear()
    make_checkpoint(root / "iter_0000010", step=10)  # 10 is loadable again
    for marker in ("metadata.json", ".metadata"):
        (root / "iter_0000015" / marker).unlink()
    step, log = _chosen(root, caplog)
    assert step == 10, log


@pytest.mark.parametrize("strict", ["log_unexpected", "ignore_all"])
def test_a_fallback_never_leaves_a_key_the_older_checkpoint_lacks_with_the_damaged_ones_value(tmp_path, strict):
    """The latest (20) holds "a" and "b" and is damaged; the older 10 holds only "a". The failed
    load may have filled "b" with 20's values (or its damaged bytes): under a mode that skips a
    key the checkpoint lacks, the fallback would return that. It raises instead."""
    root = tmp_path / "r"

    def sd(values: dict[str, float]) -> dict:
        return {k: ShardedTensor.from_rank_offsets(k, torch.full((4096,), v)) for k, v in values.items()}

    ckptd.save(sd({"a": 1.0}), root / step_dir_name(10))
    ckptd.save(sd({"b": 2.0, "a": 2.0}), root / step_dir_name(20))
    (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(20)))
    data = root / step_dir_name(20) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # bit rot in the last item read
    data.write_bytes(bytes(raw))
    request = sd({"a": 0.0, "b": 0.0})
    with pytest.raises(LoadMismatchError, match="'b'"):
        load_latest(root, request, {}, 0, {"strict": strict})


def _resume_own_key(rank: int, world: int, root: str) -> str:
    """Rank 0 asks for "a" (damaged in the latest), rank 1 for "b" (intact there, absent from the
    older checkpoint): what each got."""
    key = "ab"[rank]
    request = {key: ShardedTensor.from_rank_offsets(key, torch.zeros(4096))}
    try:
        load_latest(Path(root), request, {}, rank, {"strict": "log_unexpected"})
    except LoadMismatchError as exc:
        return f"raised: {exc}"
    return f"loaded {request[key].data[0].item()}"


@pytest.mark.timeout(120)
def test_a_rank_that_loaded_all_of_a_checkpoint_another_rank_found_damaged_is_not_left_with_its_values(tmp_path):
    """Rank 1 loaded "b" of step 20 completely, rank 0 found its "a" damaged: the fallback to step
    10, which lacks "b", raises (on every rank, as every outcome of a resume is agreed) rather than
    leave rank 1 with step 20's "b" beside step 10's "a". Before, only the ranks whose load failed
    counted as having filled their state dict."""
    root = tmp_path / "r"
    ckptd.save({"a": ShardedTensor.from_rank_offsets("a", torch.full((4096,), 1.0))}, root / step_dir_name(10))
    ckptd.save(
        {k: ShardedTensor.from_rank_offsets(k, torch.full((4096,), 2.0)) for k in ("b", "a")}, root / step_dir_name(20)
    )
    (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(20)))
    data = root / step_dir_name(20) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF  # in "a", stored last
    data.write_bytes(bytes(raw))
    out = run_ranks(_resume_own_key, 2, str(root), timeout_s=90)
    for said in out:  # the outcome is agreed: every rank raises
        assert said.startswith("raised:") and "['b']" in said and "from the damaged iter_0000020" in said, out


def test_partial_saves_are_never_candidates(tmp_path, caplog):
    root = tmp_path / "r"
    make_checkpoint(root / "iter_0000009.tmp")  # complete-looking, but never committed
    assert _chosen(root, caplog) == (None, "")  # a fresh start: nothing was ever committed
    make_root(root, [1], latest=None)
    step, log = _chosen(root, caplog)
    assert step == 1 and "no tracker file" in log


def test_nothing_loadable_raises_instead_of_starting_over(tmp_path):
    root = make_root(tmp_path / "r", [1, 2], latest=2)
    for step in (1, 2):
        (root / step_dir_name(step) / ".metadata").unlink()
    with pytest.raises(
        CorruptCheckpointError,
        match=r"no other committed checkpoint .* is loadable.*"
        r"iter_0000001: .*\.metadata is missing.*Restore the checkpoint",
    ):
        resolve_latest(root)
    shutil.rmtree(root / "iter_0000001")
    shutil.rmtree(root / "iter_0000002")
    with pytest.raises(CorruptCheckpointError, match="names 'iter_0000002'"):
        resolve_latest(root)  # the tracker says something was committed: never silently start over


@pytest.mark.timeout(60)
def test_checkpointer_latest_and_load_fall_back_then_the_next_commit_repairs_the_tracker(tmp_path, monkeypatch, caplog):
    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        job.committed(2)
        (job.root / "latest").write_text("iter_0000099\n")  # names a checkpoint that does not exist
        with caplog.at_level(logging.WARNING, logger="ckptd.recovery"):
            assert job.ckpt.latest() == 2
            loads_bit_exact(job.ckpt, job.ckpt.latest())
        assert "iter_0000099" in caplog.text and "resuming from" in caplog.text
        os.truncate(job.root / "iter_0000002" / "__0_0.distcp", 100)  # now the newest is damaged too
        assert job.ckpt.latest() == 1
        out = job.ckpt.load(state_dict(-1, torch.zeros(64, 48)))
        assert out["iteration"] == 1 and not str(job.ckpt.checkpoint_dir()).endswith(".tmp")
        # The next commit replaces the tracker that names a missing checkpoint.
        job.committed(3)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ckptd.recovery"):
            assert job.ckpt.latest() == 3
        assert caplog.text == ""
        assert (job.root / "latest").read_text().strip() == "iter_0000003"


@pytest.mark.timeout(60)
def test_a_checkpoint_naming_an_unknown_class_is_neither_resumed_past_nor_rolled_back_from(tmp_path, monkeypatch):
    """Step 10's ``.metadata`` names a class of a newer writer; step 5 is intact; Megatron-LM's
    tracker names 10 and there is no ``latest``. The daemon's start took 10 for damaged and wrote
    both trackers back to 5 ("a crash had interrupted its commit"), and the resume loaded 5."""
    root = tmp_path / "ckpts"
    for step in (5, 10):
        ckptd.save(state_dict(step), root / step_dir_name(step))
    (root / MEGATRON_TRACKER).write_text("10")
    rewrite_as_future_class(root / "iter_0000010")
    written = (root / "iter_0000010" / ".metadata").read_bytes()
    run = offline_cli("verify", str(root / "iter_0000010"))
    assert run.returncode == 3 and ": UNSUPPORTED" in run.stdout and "DAMAGED" not in run.stdout, run.stdout
    assert f"{FUTURE_MODULE}.{FUTURE_CLASS}" in run.stdout
    with single_job(tmp_path, monkeypatch, root=root) as job:
        assert job.ckpt.status()["pid"] == job.daemon_pid  # the daemon started (as coordinator)
        assert not (root / TRACKER_FILE).exists() and (root / MEGATRON_TRACKER).read_text() == "10"
        assert "iter_0000010 may be the last commit, but cannot be judged" in job.daemon_log()
        named = rf"iter_0000010/\.metadata names the class {FUTURE_MODULE}\.{FUTURE_CLASS}.*upgrade ckptd"
        with pytest.raises(UnknownClassError, match=named + r".*allow_unsafe_pickle=True.*never falls back"):
            job.ckpt.resume(state_dict(-1, torch.zeros(64, 48)))
        with pytest.raises(UnknownClassError, match=named):
            job.ckpt.latest()
        # Trusted, with the writer's library installed, the resume loads it.
        with future_writer_importable():
            out = job.ckpt.resume(state_dict(-1, torch.zeros(64, 48)), allow_unsafe_pickle=True)
        assert torch.equal(out["w"], values(10)) and out["iteration"] == 10
        job.committed(11)
        assert (root / TRACKER_FILE).read_text().strip() == "iter_0000011"
    assert (root / "iter_0000010" / ".metadata").read_bytes() == written
