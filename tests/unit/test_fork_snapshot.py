"""Copy-on-write snapshots (ckptd.staging.fork) and the daemon's wait for them (ckptd.daemon.snapshot).

Real forked processes and a real /dev/shm segment; no daemon needed at this level (the
integration tests run the whole path with the daemon).
"""

from __future__ import annotations

import os
import secrets
import time

import pytest
import torch

from ckptd.daemon.snapshot import SnapshotWait
from ckptd.errors import StagingError
from ckptd.format.items import PlannedItem
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.staging.fork import SEAL_NBYTES, SEAL_ROOM_NBYTES, child_copies, fork_snapshot, reap
from ckptd.staging.pool import place, slot_view
from ckptd.staging.segment import ShmSegment


@pytest.fixture
def segment():
    seg = ShmSegment.create(f"ckptd-test-fork-{secrets.token_hex(4)}", 8 << 20)
    yield seg
    seg.close()
    seg.unlink()


def _items(tensors: list[torch.Tensor], blob: bytes) -> list[PlannedItem]:
    items = [PlannedItem(ItemRecord(f"t{i}", TENSOR, 0, "float32", tuple(t.shape), (0,) * t.dim(),
                                    tuple(t.shape)), t) for i, t in enumerate(tensors)]
    items.append(PlannedItem(ItemRecord("obj", BYTES, 0), blob))
    return items


@pytest.mark.timeout(60)
def test_child_copies_the_values_at_fork_time(segment):
    tensors = [torch.randn(1000), torch.randn(256, 1024), torch.randn(0)]
    expected = [t.clone() for t in tensors]
    items = _items(tensors, b"pickled object bytes")
    placements, nbytes = place(items)
    assert nbytes + SEAL_ROOM_NBYTES <= segment.nbytes
    copies = child_copies(items, placements, segment)
    assert copies is not None
    snap = fork_snapshot(copies, segment, nbytes)
    for t in tensors:
        t.fill_(float("nan"))  # training overwrites right after save() returned
    wait = SnapshotWait.open(0, snap.pid, snap.seal, snap.seal_offset, segment.nbytes)
    for p in placements:  # as the daemon's writer does: each item once the child has copied it
        wait.wait_for(segment, p.offset + p.nbytes, timeout_s=30)
        assert wait.progress(segment) >= p.offset + p.nbytes
    wait.wait(segment, timeout_s=30)
    assert wait.progress(segment) == nbytes and wait.sealed(segment)
    assert reap([snap.pid], block=True) == []
    for t, p, ref in zip(tensors, placements, expected):
        assert torch.equal(slot_view(segment.base, p, torch.float32, ref.shape), ref)
    assert bytes(segment.view(placements[-1].offset, placements[-1].nbytes)) == b"pickled object bytes"


def test_non_plain_shards_are_not_forked(segment):
    strided = torch.randn(8, 8).t()  # not contiguous: the trainer stages it
    items = _items([strided], b"")
    placements, _ = place(items)
    assert child_copies(items, placements, segment) is None


@pytest.mark.timeout(60)
def test_a_child_that_dies_before_sealing_fails_the_save(segment):
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # exits without copying or sealing: as if killed half-way
    wait = SnapshotWait.open(3, pid, secrets.token_bytes(SEAL_NBYTES), 4096, segment.nbytes)
    with pytest.raises(StagingError, match=f"rank 3: snapshot process {pid} exited before it had copied"):
        wait.wait_for(segment, 100, timeout_s=30)  # nothing was copied: no progress, no seal
    wait = SnapshotWait.open(3, pid, secrets.token_bytes(SEAL_NBYTES), 4096, segment.nbytes)
    with pytest.raises(StagingError, match=f"rank 3: snapshot process {pid} exited before it had copied"):
        wait.wait(segment, timeout_s=30)
    reap([pid], block=True)
    # Already reaped when the SAVE arrives (its trainer died): the seal alone decides.
    gone = SnapshotWait.open(3, pid, secrets.token_bytes(SEAL_NBYTES), 4096, segment.nbytes)
    with pytest.raises(StagingError, match="exited before"):
        gone.wait(segment, timeout_s=1)


@pytest.mark.timeout(60)
def test_a_child_that_hangs_times_out(segment):
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        wait = SnapshotWait.open(1, pid, secrets.token_bytes(SEAL_NBYTES), 0, segment.nbytes)
        t0 = time.monotonic()
        with pytest.raises(StagingError, match="did not finish copying within 0.3 s"):
            wait.wait(segment, timeout_s=0.3)
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, 9)
        reap([pid], block=True)


def test_malformed_snapshot_requests_are_refused(segment):
    for pid, seal, at in ((0, b"x" * SEAL_NBYTES, 0), (os.getpid(), b"short", 0),
                          (os.getpid(), b"x" * SEAL_NBYTES, segment.nbytes)):
        with pytest.raises(StagingError, match="malformed snapshot"):
            SnapshotWait.open(0, pid, seal, at, segment.nbytes)
