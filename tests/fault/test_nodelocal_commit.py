"""A commit on node-local disks (ckptd.roots.nodelocal) from the real code, with no daemon: two
ranks' files written on two "nodes" (two roots: each node's disk), the coordinator's commit on
node 0's disk, which cannot see node 1's file, and node 1's part of the commit on its own disk."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.control.protocol import StepCommitted
from ckptd.daemon.nodelocal import NodeLocalCommits
from ckptd.daemon.workers import Completions, NodeCommitFinished, WorkerPools, write_rank_file
from ckptd.errors import CkptdError, CorruptCheckpointError, ProtocolError
from ckptd.format.commitrecord import read_commit_record
from ckptd.format.finalize import serialize_common
from ckptd.format.items import plan_tensor_items
from ckptd.format.rootlayout import tmp_dir
from ckptd.recovery import resolve_latest
from ckptd.roots.nodelocal import NODE_FILES
from ckptd.roots.posix import tracker_step
from ckptd.roots.posix_data import PosixDataTarget
from ckptd.roots.posix_root import PosixRoot
from ckptd.verify import verify_checkpoint
from tests.rings import produced_save
from tools.harness.waiting import wait_until

A = "0123456789ab-1"
STEP = 5


def _write(root, rank: int, values: torch.Tensor, step: int = STEP, attempt: str = A):
    """Rank ``rank``'s file of ``attempt`` in its node's ``root``: (records, file size)."""
    sh = ShardedTensor.from_rank_offsets("w", values, (0, rank, 2))
    with produced_save(step, plan_tensor_items(sh, rank)) as save:
        target = PosixDataTarget(tmp_dir(root, step, attempt), rank, open, True)
        return write_rank_file(target, save.ring, save.request, True, save.wait, 30)


@pytest.fixture
def nodes(tmp_path):
    """Node 0's and node 1's disks, each holding its rank's file of attempt A of step 5."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for d in disks:
        d.mkdir()
    halves = [torch.arange(64.0), torch.arange(64.0, 128.0)]
    written = [_write(disks[r], r, halves[r]) for r in (0, 1)]
    return disks, written, torch.cat(halves)


def _commit(disk, written, step: int = STEP, attempt: str = A):
    store = PosixRoot(disk, node_local=True)
    records = written[0][0] + written[1][0]
    files = {f"__{r}_0.distcp": (r, written[r][1]) for r in (0, 1)}
    return store.commit(
        step, attempt, records, serialize_common({"iteration": step}), files, elsewhere=frozenset({"__1_0.distcp"})
    )


def test_node_0_commits_without_node_1s_file_and_node_1_finishes_the_same_commit(nodes):
    (disk0, disk1), written, whole = nodes
    outcome = _commit(disk0, written)
    assert sorted(outcome.files) == sorted(NODE_FILES)
    record = read_commit_record(disk0 / "iter_0000005")
    assert record is not None and record.objects == {f"__{r}_0.distcp": {"nbytes": written[r][1]} for r in (0, 1)}
    assert not (disk0 / "iter_0000005" / "__1_0.distcp").exists()  # on node 1's disk only

    node1 = PosixRoot(disk1, node_local=True)
    assert not node1.holds_commit(STEP, A)
    node1.finish_on_node(STEP, A, outcome.files)
    assert node1.holds_commit(STEP, A) and tracker_step(disk1) == STEP
    assert not tmp_dir(disk1, STEP, A).exists()
    for name in NODE_FILES:
        assert (disk1 / "iter_0000005" / name).read_bytes() == (disk0 / "iter_0000005" / name).read_bytes()
    node1.finish_on_node(STEP, A, outcome.files)  # a repeated verdict: nothing to do

    # Each disk holds its own rank's file; the two together are the checkpoint, bit-exact.
    with pytest.raises(CorruptCheckpointError, match="__0_0.distcp is missing"):
        ckptd.load_plain_tensors(disk1 / "iter_0000005")
    shutil.copy(disk0 / "iter_0000005" / "__0_0.distcp", disk1 / "iter_0000005")
    assert torch.equal(ckptd.load_plain_tensors(disk1 / "iter_0000005")["w"], whole)


def test_a_shared_root_still_checks_every_file(nodes):
    (disk0, _), written, _ = nodes
    store = PosixRoot(disk0)
    files = {f"__{r}_0.distcp": (r, written[r][1]) for r in (0, 1)}
    with pytest.raises(CorruptCheckpointError, match="rank 1's data file .* is missing"):
        store.commit(STEP, A, written[0][0] + written[1][0], serialize_common({}), files)


def test_node_1_refuses_files_that_are_not_the_commits_and_says_when_it_has_none(nodes):
    (disk0, disk1), written, _ = nodes
    outcome = _commit(disk0, written)
    node1 = PosixRoot(disk1, node_local=True)
    with pytest.raises(ProtocolError, match="carried files"):
        node1.finish_on_node(STEP, A, {**outcome.files, "../evil": b"x"})
    with pytest.raises(ProtocolError, match="not that commit's"):
        node1.finish_on_node(STEP, "0123456789ab-2", outcome.files)
    shutil.rmtree(tmp_dir(disk1, STEP, A))
    with pytest.raises(CkptdError, match="this node holds no files of step 5"):
        node1.finish_on_node(STEP, A, outcome.files)
    assert not (disk1 / "iter_0000005").exists()


def test_node_1_replaces_a_step_the_coordinator_replaced(nodes):
    """A rollback abandoned step 5 and a new attempt saved it again: node 0 replaced its copy, and
    so does node 1 (its old iter_0000005 goes)."""
    (disk0, disk1), written, _ = nodes
    node1 = PosixRoot(disk1, node_local=True)
    node1.finish_on_node(STEP, A, _commit(disk0, written).files)
    # Step 3 committed after step 5 (the rollback), then step 5 again by attempt B.
    b = "0123456789ab-2"
    three = [_write(d, r, torch.zeros(64), step=3, attempt=b) for r, d in enumerate((disk0, disk1))]
    node1.finish_on_node(3, b, _commit(disk0, three, step=3, attempt=b).files)
    again = [_write(d, r, torch.ones(64), attempt=b) for r, d in enumerate((disk0, disk1))]
    node1.finish_on_node(STEP, b, _commit(disk0, again, attempt=b).files)
    record = read_commit_record(disk1 / "iter_0000005")
    assert record is not None and record.attempt == b and tracker_step(disk1) == STEP
    assert not list(disk1.glob("*.deleting"))


def test_each_disk_verifies_and_resumes_with_its_own_files_only(nodes):
    """`ckptd verify` and the choice of a checkpoint to resume from check each node's own files
    against the commit's sizes; those of other nodes are noted, not taken for damage."""
    (disk0, disk1), written, _ = nodes
    PosixRoot(disk1, node_local=True).finish_on_node(STEP, A, _commit(disk0, written).files)
    for disk in (disk0, disk1):
        report = verify_checkpoint(disk / "iter_0000005")
        assert report.ok, report.errors
        assert any("1 of 2 data files are on other nodes' disks" in f.message for f in report.findings)
        choice = resolve_latest(disk)
        assert choice is not None and choice.step == STEP and choice.fallback_reason is None
    with open(disk1 / "iter_0000005" / "__1_0.distcp", "ab") as f:
        f.write(b"x")  # this node's own file no longer has the committed size
    report = verify_checkpoint(disk1 / "iter_0000005")
    assert [f.message for f in report.errors] == [
        f"data file __1_0.distcp has {written[1][1] + 1} bytes, its commit recorded {written[1][1]}"
    ]
    # This node's own file lost: no data file of the commit left on the disk (it said OK, exit 0).
    (disk1 / "iter_0000005" / "__1_0.distcp").unlink()
    report = verify_checkpoint(disk1 / "iter_0000005")
    assert not report.ok and "none of the 2 data files the commit records is on this disk" in report.errors[0].message


def test_commit_files_too_large_for_a_message_stay_home_and_the_node_says_so(nodes):
    """A commit whose metadata files exceed half the message limit is not sent to the nodes (the
    verdict would not fit a message); node 1 then tells its ranks the step is committed but not on
    its disk, and its files stay in the attempt's directory for the mirror and a resume."""
    (disk0, disk1), written, _ = nodes
    node0 = PosixRoot(disk0, node_local=True, message_nbytes=1024)
    records = written[0][0] + written[1][0]
    files = {f"__{r}_0.distcp": (r, written[r][1]) for r in (0, 1)}
    outcome = node0.commit(
        STEP, A, records, serialize_common({"iteration": STEP}), files, elsewhere=frozenset({"__1_0.distcp"})
    )
    assert outcome.files == {}
    verdict = StepCommitted(step=STEP, attempt=A, name=outcome.name, warnings=[])
    completions = Completions()
    workers = WorkerPools(1, completions)
    try:
        node1 = NodeLocalCommits(PosixRoot(disk1, node_local=True), workers)
        assert node1.takes(verdict)  # held back from the ranks while the commit thread works
        (done,) = wait_until(completions.drain, 30, "node 1's part of the commit")
        assert isinstance(done, NodeCommitFinished) and "without the commit's files" in str(done.error)
        told = node1.done(done)
    finally:
        assert workers.shutdown(timeout_s=30)
        completions.close()
    assert told.local_files == {} and "but not on this node's disk" in told.warnings[-1]
    assert tmp_dir(disk1, STEP, A).is_dir() and not (disk1 / "iter_0000005").exists()


def test_what_this_nodes_part_of_a_commit_noticed_reaches_its_ranks(tmp_path):
    """This node's disk took the commit, but its tracker could not name it (nor the directory be
    renamed back): the commit stands, and its ranks are told so with the warning, which used to be
    dropped (only the coordinator's warnings and a failure's went on)."""
    from ckptd.roots.base import CommitOutcome

    verdict = StepCommitted(step=STEP, attempt=A, name="iter_0000005", warnings=["from the coordinator"])
    untracked = "the tracker latest could not name it"
    done = NodeCommitFinished(verdict=verdict, result=CommitOutcome(name="iter_0000005", warnings=(untracked,)))
    told = NodeLocalCommits(PosixRoot(tmp_path, node_local=True), None).done(done)  # type: ignore[arg-type]
    assert told.warnings == ["from the coordinator", untracked] and told.local_files == {}


def test_a_commit_the_tracker_cannot_name_leaves_retention_for_later(nodes, monkeypatch):
    """After a rollback to step 30, node 0's commit of 31 is in place, but neither its tracker write
    nor the rename back worked: the commit stands with a warning, and retention does not run
    while ``latest`` still names 40. It ran, by commit order with 40 taken for the current branch:
    ``keep_last=2`` kept 31 and 40 and removed 30, the step rolled back to (40 is the abandoned
    one once the next start names 31 latest)."""
    import errno
    import os

    from ckptd.format.durable import default_opener
    from ckptd.format.safefs import Dir

    (disk0, disk1), written, _ = nodes
    store = PosixRoot(disk0, node_local=True, keep_last=2)
    files = {f"__{r}_0.distcp": (r, written[r][1]) for r in (0, 1)}
    records = written[0][0] + written[1][0]
    for step in (30, 40, 31):
        for disk in (disk0, disk1):
            shutil.copytree(tmp_dir(disk, STEP, A), tmp_dir(disk0, step, A), dirs_exist_ok=True)
    for step in (30, 40):
        store.commit(step, A, records, serialize_common({"iteration": step}), files)
    assert tracker_step(disk0) == 40

    def opener(path, mode):
        if os.path.basename(path).startswith("latest"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return default_opener(path, mode)

    rename = Dir.rename

    def no_way_back(self, old, new):
        if old == "iter_0000031":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), old)
        return rename(self, old, new)

    monkeypatch.setattr(Dir, "rename", no_way_back)
    store.opener = opener
    outcome = store.commit(31, A, records, serialize_common({"iteration": 31}), files)
    assert any("is committed, complete and in place" in w for w in outcome.warnings), outcome.warnings
    assert tracker_step(disk0) == 40
    assert all((disk0 / f"iter_{s:07d}").is_dir() for s in (30, 31, 40))


def test_after_node_0s_disk_is_replaced_node_1_keeps_the_new_commits(tmp_path):
    """Node 0's disk is replaced (empty): it numbered its commits from 1 again, under node 1's
    commits of the old disk, so node 1's retention (keep 2) kept the old disk's highest steps and
    removed the new commits, of which node 0 holds the other half. Node 0 numbers above the highest
    number node 1 reports of its disk (Written.disk_seq), and node 1's old steps pass for a branch
    left behind."""
    disk0, disk1 = tmp_path / "node0", tmp_path / "node1"
    old0 = tmp_path / "old-node0"
    for d in (disk0, disk1, old0):
        d.mkdir()
    node1 = PosixRoot(disk1, node_local=True, keep_last=2)

    def commit(disk: object, step: int, attempt: str) -> None:
        written = [
            _write(d, r, torch.full((64,), float(step)), step=step, attempt=attempt)
            for r, d in enumerate((disk, disk1))
        ]
        store = PosixRoot(disk, node_local=True, keep_last=2)  # type: ignore[arg-type]
        records = written[0][0] + written[1][0]
        files = {f"__{r}_0.distcp": (r, written[r][1]) for r in (0, 1)}
        outcome = store.commit(
            step,
            attempt,
            records,
            serialize_common({"iteration": step}),
            files,
            elsewhere=frozenset({"__1_0.distcp"}),
            seq_floor=node1.highest_commit_seq(),  # what node 1's WRITTEN reports
        )
        node1.finish_on_node(step, attempt, outcome.files)

    for step in (80, 90, 100, 130):  # the old disk's history; the mirror had copied 100
        commit(old0, step, "0123456789ab-1")
    assert sorted(p.name for p in disk1.glob("iter_*")) == ["iter_0000100", "iter_0000130"]
    for step in (110, 120):  # the new disk, resumed from the mirror's 100
        commit(disk0, step, "fedcba987654-1")
    kept = sorted(p.name for p in disk1.glob("iter_*"))
    assert kept == ["iter_0000110", "iter_0000120"], kept  # 100 older, 130 a branch left behind
    record = read_commit_record(disk0 / "iter_0000110")
    assert record is not None and record.seq == 5  # above node 1's 4
