"""A commit never repeats a number a commit record in the root may hold, through the real commit
path (ckptd.roots.posix.commit_step) on real files: not the number of a checkpoint that lost its
markers, nor one it cannot read right now (then the commit fails, and nothing of it is visible).

A repeated number ordered the two commits by step: after a rollback the step the job left passed
for the newest commit, retention removed the step the job had gone back to, and a daemon start
pointed the tracker at the left one.
"""

from __future__ import annotations

import os
import traceback
from multiprocessing import Queue
from pathlib import Path

import pytest
import torch

from ckptd import ShardedTensor
from ckptd.catalog import scan_root
from ckptd.errors import CorruptCheckpointError
from ckptd.format.commitrecord import COMMIT_RECORD, read_commit_record
from ckptd.format.finalize import serialize_common, write_rank_files
from ckptd.format.items import plan_tensor_items
from ckptd.format.layout import DCP_METADATA, METADATA_JSON, data_file_name
from ckptd.format.rootlayout import step_dir_name, tmp_dir
from ckptd.recovery import resolve_latest
from ckptd.retention import plan_gc
from ckptd.roots.posix import commit_step, finish_interrupted_commit, remove_tmp
from tests.filemodes import obey_file_modes
from tools.harness.ranks import spawn_queue, spawned


def _commit(root: Path, step: int, *, keep_last: int = 0, attempt: str = "0123456789ab-1") -> None:
    """Rank 0 writes its file of ``step``; the coordinator commits it (retention: ``keep_last``)."""
    tmp = tmp_dir(root, step, attempt)
    tmp.mkdir(parents=True)
    items = plan_tensor_items(ShardedTensor.from_rank_offsets("w", torch.full((64,), float(step))), 0)
    records = write_rank_files(tmp, [items], fsync=False)
    files = {data_file_name(0): (0, (tmp / data_file_name(0)).stat().st_size)}
    commit_step(
        root,
        step,
        attempt,
        records,
        serialize_common({"iteration": step}),
        files,
        fsync=False,
        keep_last=keep_last,
        megatron_tracker=False,
    )


def _committed(root: Path, *steps: int) -> Path:
    root.mkdir()
    for step in steps:
        _commit(root, step)
    return root


def _seq(root: Path, step: int) -> int:
    record = read_commit_record(root / step_dir_name(step))
    assert record is not None
    return record.seq


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


def test_a_commit_after_a_fallback_past_a_checkpoint_without_markers_is_numbered_above_it(tmp_path):
    """40 lost metadata.json and .metadata: the resume fell back to 30, and the job's 31 got 40's
    number. With the markers restored, 40 passed for the newest commit: a daemon start named it
    latest, and the job resumed the step it had left."""
    root = _committed(tmp_path / "r", 10, 20, 30, 40)
    markers = {name: (root / "iter_0000040" / name).read_bytes() for name in (METADATA_JSON, DCP_METADATA)}
    for name in markers:
        (root / "iter_0000040" / name).unlink()
    assert resolve_latest(root).entry.name == "iter_0000030"  # type: ignore[union-attr]
    _commit(root, 31)
    assert _seq(root, 31) == 5 > _seq(root, 40) == 4
    for name, raw in markers.items():  # restored, as the resume's warning advises
        (root / "iter_0000040" / name).write_bytes(raw)
    cat = scan_root(root, usage=False)
    assert [e.name for e in cat.newest_first][:2] == ["iter_0000031", "iter_0000040"]
    assert [e.name for e in cat.off_branch()] == ["iter_0000040"]
    assert finish_interrupted_commit(root, fsync=False, megatron_tracker=False) is None
    assert resolve_latest(root).entry.name == "iter_0000031"  # type: ignore[union-attr]
    # Retention keeps the branch the job trains on: 31 and the step it went back to.
    assert [r.entry.name for r in plan_gc(cat, 2).remove] == ["iter_0000010", "iter_0000020", "iter_0000040"]


def test_a_damaged_commit_record_fails_the_commit_instead_of_sharing_its_number(tmp_path):
    root = _committed(tmp_path / "r", 10, 20, 30, 40)
    (root / "iter_0000040" / COMMIT_RECORD).write_bytes(b'{"seq": 4, "st\xffep')  # bit rot
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000040/ckptd_commit\.json is restored") as err:
        _commit(root, 25, keep_last=2)  # the job went back to 20
    assert "commit record of iter_0000040 cannot be read" in str(err.value)
    # Nothing of it is visible, and nothing was removed.
    assert (root / "latest").read_text() == "iter_0000040\n"
    assert _steps(root) == ["iter_0000010", "iter_0000020", "iter_0000025.0123456789ab-1.tmp"] + [
        "iter_0000030",
        "iter_0000040",
    ]


def _unreadable_record_then_readable(tmp: str, queue: Queue) -> None:
    """The job went back to 20 and saves 25 while 40's commit record cannot be read (EACCES here;
    an NFS server's EIO or ESTALE alike); then again once it can."""
    try:
        root = _committed(Path(tmp) / "r", 10, 20, 30, 40)
        record = root / "iter_0000040" / COMMIT_RECORD
        os.chmod(record, 0)
        why = obey_file_modes()
        if why is not None:
            queue.put(("skip", why))
            return
        try:
            _commit(root, 25, keep_last=2)
            first = "committed"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            first = f"{type(exc).__name__}: {exc}"
            remove_tmp(root, 25, "0123456789ab-1")  # the coordinator aborts the attempt
        after_failure = (_steps(root), (root / "latest").read_text())
        os.chmod(record, 0o644)
        if first != "committed":
            _commit(root, 25, keep_last=2, attempt="0123456789ab-2")  # the next save
        queue.put(("ok", (first, after_failure, _steps(root), _seq(root, 25), (root / "latest").read_text())))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))


@pytest.mark.timeout(120)
def test_a_commit_record_the_storage_fails_to_return_fails_the_commit_and_the_next_save_commits(tmp_path):
    """The read failed once: its checkpoint counted as number 0, so 25 was numbered 4, as 40 is;
    25's retention (keep_last=2) removed 10, 20 and 30 and kept 40, and the next daemon start named
    40 latest."""
    queue = spawn_queue()
    with spawned([(_unreadable_record_then_readable, (str(tmp_path), queue))], join_timeout_s=60):
        kind, out = queue.get(timeout=100)
    if kind == "skip":
        pytest.skip(out)
    assert kind == "ok", out
    first, (steps_then, latest_then), steps, seq, latest = out
    assert first.startswith("StorageError: ") and "commit record of iter_0000040 cannot be read" in first, first
    assert "(EACCES)" in first and "the next save tries again" in first, first
    assert steps_then == ["iter_0000010", "iter_0000020", "iter_0000030", "iter_0000040"], steps_then
    assert latest_then == "iter_0000040\n"
    # Numbered after 40: 40 and 30 are the branch the job left; 20, the step it went back to, stays.
    assert seq == 5 and latest == "iter_0000025\n"
    assert steps == ["iter_0000020", "iter_0000025"], steps
