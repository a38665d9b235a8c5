"""Resuming from node-local disks (config ``node_local``): the decision as a pure function of what
each rank found (ckptd.roots.mirror.resume_from), and the structural check of a node's disk, which
holds only its own ranks' data files."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import CorruptCheckpointError
from ckptd.recovery import resolve_resumable
from ckptd.roots.mirror import LOCAL, MIRROR, CommitRef, LocalFind, resume_from
from ckptd.storage.nodeview import data_file_rank


def ref(step: int, seq: int = 0, attempt: str = "") -> CommitRef:
    return CommitRef(step=step, attempt=attempt or f"a{step}", seq=seq or step)


def find(commit: CommitRef | None, holds: bool = False) -> LocalFind:
    return LocalFind(commit=commit, holds_mirrored=holds)


def test_node_local_disks_resume_from_node_0s_commit_even_where_a_node_lags_behind():
    # node 1's daemon died before it renamed step 30 into place: its disk's latest is step 20
    found = [find(ref(30), holds=True), find(ref(20))]
    assert resume_from(found, ref(20), node_local=True) == (LOCAL, ref(30))
    # the mirror lags too (its latest copy is of step 10): still node 0's commit, no rollback
    assert resume_from([find(ref(30)), find(ref(20))], ref(10), node_local=True) == (LOCAL, ref(30))
    # a replaced node 1 (an empty disk) reads node 0's commit as well
    assert resume_from([find(ref(30)), find(None)], None, node_local=True) == (LOCAL, ref(30))
    # the same finds on a shared root mean ranks that read it at different moments: the oldest
    # commit they found (there for all), unless the mirror's copy is newer. Before, every rank read
    # the mirror, whatever its age: a mirror hours behind rolled the job back, silently.
    assert resume_from([find(ref(30)), find(ref(20))], ref(10), node_local=False, rank=1) == (LOCAL, ref(20))
    assert resume_from([find(ref(30)), find(ref(20))], ref(25), node_local=False, rank=1) == (MIRROR, ref(25))
    assert resume_from([find(ref(30)), find(None)], ref(10), node_local=False, rank=1) == (MIRROR, ref(10))
    assert resume_from([find(ref(30)), find(ref(30))], ref(10), node_local=False, rank=1) == (LOCAL, ref(30))


def test_node_local_disks_resume_from_the_mirror_only_where_node_0_lacks_its_copy():
    # a replaced node 0 (an empty disk): the mirror's latest copy, whatever the other nodes hold
    assert resume_from([find(None), find(ref(30))], ref(30), node_local=True) == (MIRROR, ref(30))
    # node 0's disk restored from an old backup: the newer mirror copy wins
    assert resume_from([find(ref(10)), find(ref(30))], ref(30), node_local=True) == (MIRROR, ref(30))
    # a rollback node 0 still records (it holds the mirrored 30, then committed 15): node 0's 15
    rollback = ref(15, seq=40)
    assert resume_from([find(rollback, holds=True), find(ref(30))], ref(30), node_local=True) == (LOCAL, rollback)
    # nothing anywhere on node 0 nor in the mirror: nothing to resume (the caller says so)
    assert resume_from([find(None), find(ref(30))], None, node_local=True) == (LOCAL, None)


def test_a_data_file_is_matched_to_its_rank_on_a_disk_and_in_a_mirror():
    assert data_file_rank("__3_0.distcp") == 3
    assert data_file_rank("__12_0.0123456789ab-1-m1a2b3c4d.distcp") == 12
    assert data_file_rank("__1_0.distcp.abc.part") is None
    assert data_file_rank("__1_1.distcp") is None and data_file_rank("common.pt") is None
    assert data_file_rank("../__1_0.distcp") is None


def test_a_nodes_disk_missing_other_nodes_data_files_is_a_resumable_checkpoint(tmp_path):
    """node_local: a node's disk holds only its ranks' data files; the structural check that picks
    the checkpoint to resume from checks its metadata, not data files another node holds."""
    root = tmp_path / "root"
    ckptd.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, root / "iter_0000010")
    (root / "latest").write_text("iter_0000010\n")
    (root / "iter_0000010" / "__0_0.distcp").unlink()  # rank 0 ran on another node
    with pytest.raises(CorruptCheckpointError, match="missing"):
        resolve_resumable(root)  # a shared root without the file is damaged, as before
    choice = resolve_resumable(root, node_local=True)
    assert choice is not None and choice.step == 10 and choice.fallback_reason is None
    (root / "iter_0000010" / ".metadata").write_bytes(b"garbage")  # its metadata is still checked
    with pytest.raises(CorruptCheckpointError):
        resolve_resumable(root, node_local=True)
