"""Guarantee 1, the order of durable steps of one save (daemon write + coordinator commit), recorded
from the real code: every file is fsynced before the rename that publishes it, its directory is
fsynced after, the checkpoint directory gets its final name only after all of that, and the
``latest`` tracker names it only after the root directory was fsynced."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ckptd import ShardedTensor
from ckptd.daemon.workers import write_rank_file
from ckptd.format.commitrecord import COMMIT_RECORD
from ckptd.format.finalize import serialize_common
from ckptd.format.items import plan_tensor_items
from ckptd.format.rootlayout import MEGATRON_TRACKER, tmp_dir
from ckptd.roots.posix import commit_step
from ckptd.roots.posix_data import PosixDataTarget
from tests.rings import produced_save

ATTEMPT = "0123456789ab-1"


def _path_of(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_files_and_directories_are_durable_before_anything_names_them(tmp_path, monkeypatch):
    root = tmp_path / "ckpts"
    root.mkdir()
    events: list[tuple[str, str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", _path_of(fd), ""))
        real_fsync(fd)

    def _abs(path, dir_fd: int | None) -> str:  # renames may name entries of an open directory
        return str(path) if dir_fd is None else os.path.join(_path_of(dir_fd), path)

    def rename(src, dst, *a, **k) -> None:
        names = ("rename", _abs(src, k.get("src_dir_fd")), _abs(dst, k.get("dst_dir_fd")))
        real_rename(src, dst, *a, **k)
        events.append(names)

    def replace(src, dst, *a, **k) -> None:
        names = ("rename", _abs(src, k.get("src_dir_fd")), _abs(dst, k.get("dst_dir_fd")))
        real_replace(src, dst, *a, **k)
        events.append(names)

    items = plan_tensor_items(ShardedTensor.from_rank_offsets("w", torch.arange(64.0)), 0)
    with produced_save(5, items) as save:
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(os, "replace", replace)
        try:
            stored, file_nbytes = write_rank_file(
                PosixDataTarget(tmp_dir(root, 5, ATTEMPT), 0, open, True), save.ring, save.request, True, save.wait, 30
            )
            commit_step(
                root,
                5,
                ATTEMPT,
                stored,
                serialize_common({"iteration": 5}),
                {"__0_0.distcp": (0, file_nbytes)},
                fsync=True,
                keep_last=0,
                megatron_tracker=True,
            )
        finally:
            monkeypatch.undo()

    tmp, final = str(tmp_dir(root, 5, ATTEMPT)), str(root / "iter_0000005")
    index = {e: i for i, e in enumerate(events)}
    renames = [e for e in events if e[0] == "rename"]
    publish = next(e for e in renames if e[1:] == (tmp, final))
    for e in renames:
        src, dst = e[1], e[2]
        if e is publish:
            continue
        # The renamed file's own bytes were fsynced (under its temporary name) before the rename,
        # and its directory afterwards, before the checkpoint (or the tracker) is named anywhere.
        assert any(f == ("fsync", src, "") and index[f] < index[e] for f in events), (e, events)
        parent = str(Path(dst).parent)
        after = [f for f in events[index[e] + 1 :] if f == ("fsync", parent, "")]
        assert after, f"{parent} was not fsynced after {e}"
        if parent == tmp:
            assert index[after[0]] < index[publish]
    inside = [e for e in renames if Path(e[2]).parent == Path(tmp)]
    assert [Path(e[2]).name for e in inside] == [
        "__0_0.distcp",
        "common.pt",
        ".metadata",
        "metadata.json",
        COMMIT_RECORD,
    ]
    # The final name appears last inside the save, the root is fsynced, then the trackers move.
    root_sync = next(i for i, e in enumerate(events) if e == ("fsync", str(root), "") and i > index[publish])
    trackers = [e for e in renames if Path(e[2]).parent == root and e is not publish]
    assert [Path(e[2]).name for e in trackers] == ["latest", MEGATRON_TRACKER]
    assert all(index[e] > root_sync for e in trackers)
    assert (root / "latest").read_text() == "iter_0000005\n"


def _commit_at_floor(root: Path, step: int, seq_floor: int) -> None:
    """Write rank 0's file of ``step`` into ``root`` and commit it there, numbered above ``seq_floor``."""
    items = plan_tensor_items(ShardedTensor.from_rank_offsets("w", torch.arange(64.0)), 0)
    with produced_save(step, items) as save:
        stored, file_nbytes = write_rank_file(
            PosixDataTarget(tmp_dir(root, step, ATTEMPT), 0, open, True), save.ring, save.request, True, save.wait, 30
        )
    common, data_files = serialize_common({"iteration": step}), {"__0_0.distcp": (0, file_nbytes)}
    commit_step(
        root,
        step,
        ATTEMPT,
        stored,
        common,
        data_files,
        fsync=False,
        keep_last=0,
        megatron_tracker=False,
        seq_floor=seq_floor,
    )


def test_a_node_local_commit_is_numbered_above_every_nodes_disk(tmp_path):
    """Node 0's disk was replaced: numbered by its own commits alone, its first commit was 1, under
    the other disks' commits of the old disk (up to 53), which then passed for the newest there
    (retention on node 1 removed the new commits and kept the old). Node 0 numbers above the
    highest number the nodes report (Written.disk_seq)."""
    from ckptd.format.commitrecord import read_commit_record
    from ckptd.roots.posix_root import PosixRoot

    root = tmp_path / "node0"
    root.mkdir()
    _commit_at_floor(root, 110, 53)
    record = read_commit_record(root / "iter_0000110")
    assert record is not None and record.seq == 54
    assert PosixRoot(root, fsync=False, keep_last=0).highest_commit_seq() == 54  # what this disk reports


def test_a_commit_number_past_what_a_record_holds_is_refused_not_written(tmp_path):
    """A node's disk holding the highest number a record may hold: the next commit was numbered
    past it, a record every scan takes for damaged, and so every commit after it."""
    import pytest

    from ckptd.errors import CorruptCheckpointError
    from ckptd.format.commitrecord import MAX_COMMIT_SEQ

    root = tmp_path / "node0"
    root.mkdir()
    with pytest.raises(CorruptCheckpointError, match="impossible commit number"):
        _commit_at_floor(root, 7, MAX_COMMIT_SEQ)
    assert not (root / "iter_0000007").exists()
