"""Shared-memory segments and staging rings, on real /dev/shm segments (no processes)."""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

import ckptd
from ckptd import ShardedObject, ShardedTensor
from ckptd.daemon.rings import RingTable
from ckptd.daemon.snapshot import SnapshotWait
from ckptd.daemon.workers import WriteRequest, planned_items, write_rank_file
from ckptd.errors import SharedMemoryFullError, StagingError
from ckptd.format.finalize import finalize, serialize_common
from ckptd.format.items import split_large_items
from ckptd.format.saveplan import plan_save
from ckptd.format.tensorzip import RawTensor
from ckptd.roots.posix_data import PosixDataTarget
from ckptd.staging.devcopy import copy_inline
from ckptd.staging.producer import start_block
from ckptd.staging.rankside import ALIGN_NBYTES, StagingRing, place
from ckptd.staging.ring import ABANDONED, HEADER_NBYTES, NO_ROOM, RingFull, RingMap, block_offset, give_up_mark
from ckptd.staging.segment import SHM_DIR, ShmSegment, list_segments, unlink_segments
from ckptd.statedict.split import split_state_dict


@pytest.fixture
def prefix():
    p = f"ckptd-unit{secrets.token_hex(3)}-n0-"
    yield p
    leaked = unlink_segments(p)
    assert not leaked, f"test leaked segments {leaked}"


def test_segment_is_private_sparse_and_survives_its_creator_closing(prefix):
    seg = ShmSegment.create(prefix + "a", 1 << 20)
    st = os.stat(SHM_DIR / seg.name)
    # Nothing pre-faulted: creating a ring costs no time in the first save.
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_blocks == 0
    seg.write(0, bytes([1, 2, 3, 4]))
    seg.reserve()
    assert os.stat(SHM_DIR / seg.name).st_blocks * 512 >= 1 << 20
    seg.close()  # the creator unmaps: the bytes stay until someone unlinks
    other = ShmSegment.attach(prefix + "a", 1 << 20)
    assert other.base[:4].tolist() == [1, 2, 3, 4]
    with pytest.raises(StagingError, match="has 1048576 bytes, expected 4096"):
        ShmSegment.attach(prefix + "a", 4096)
    with pytest.raises(StagingError, match="already exists"):
        ShmSegment.create(prefix + "a", 4096)
    other.close()
    assert list_segments(prefix) == [prefix + "a"]
    assert unlink_segments(prefix) == [prefix + "a"] and list_segments(prefix) == []


def test_attach_refuses_foreign_permissions(prefix):
    path = SHM_DIR / (prefix + "open")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.ftruncate(fd, 4096)
    os.close(fd)
    os.chmod(path, 0o644)
    try:
        with pytest.raises(StagingError, match="not a private"):
            ShmSegment.attach(prefix + "open", 4096)
    finally:
        path.unlink()


def _state(step: int, for_load: bool = False) -> dict:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6) + step
    flat = torch.arange(10, dtype=torch.bfloat16) + step
    opt = (
        ShardedTensor.from_rank_offsets("opt", flat.reshape(2, 5))
        if for_load
        else ShardedTensor.from_rank_offsets_flat("opt", flat, (2, 5), flattened_range=slice(0, 10))
    )
    return {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "opt": opt,  # a distributed-optimizer style flattened shard, stored as N-D pieces
        "empty": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
        "i8": ShardedTensor.from_rank_offsets("i8", torch.tensor([-1, 2, 3], dtype=torch.int8)),
        "obj": ShardedObject("obj", {"step": step, "blob": b"x" * 100}, (1,), (0,)),
        "iteration": step,
    }


def _produce(ring: StagingRing, items: list, placements: list):
    """Produce a save inline (as snapshot="copy" does); the daemon's snapshot watch of it."""
    block, start = ring.claim(placements)
    seal = start_block(ring, block)
    copy_inline(ring, start, block, items, placements, seal)
    return block, start, SnapshotWait.open(0, os.getpid(), seal, block_offset(block))


def test_a_staged_save_writes_a_loadable_checkpoint_independent_of_later_mutation(prefix, tmp_path):
    split = split_state_dict(_state(5))
    items = plan_save(split, 0)
    placements, nbytes = place(items)
    assert all(p.offset % ALIGN_NBYTES == 0 for p in placements)
    ring = StagingRing.create(prefix, 0, capacity=1 << 20, timeout_s=30)
    table = RingTable(prefix)
    try:
        assert not ring.pinned  # no CUDA here: staging is pwrite
        # The daemon side: attach by name, write the rank file from views of the ring.
        daemon_ring = table.register(0, ring.generation, ring.capacity, ring.names, b"id")
        block, start, wait = _produce(ring, items, placements)
        split.sharded[("w",)].data.fill_(-1)  # training mutates right after staging
        req = WriteRequest(
            step=5, rank=0, records=[i.record for i in items], placements=placements, common=None, ring_start=start
        )
        assert all(isinstance(p.payload, (RawTensor, memoryview)) for p in planned_items(daemon_ring.map, req))
        stored, file_nbytes = write_rank_file(
            PosixDataTarget(tmp_path, 0, open, False), daemon_ring.map, req, True, wait, 30
        )
        assert file_nbytes == (tmp_path / "__0_0.distcp").stat().st_size
        assert daemon_ring.map.consumed() == req.ring_end  # the ring space is free again
        finalize(tmp_path, stored, serialize_common(split.common))
        loaded = ckptd.load(_state(0, for_load=True), tmp_path)
        ref = _state(5, for_load=True)
        for k in ("w", "opt", "empty", "i8"):
            assert torch.equal(loaded[k], ref[k].data), k
        assert loaded["obj"] == {"step": 5, "blob": b"x" * 100} and loaded["iteration"] == 5
        # A second rank's ring with a foreign name is refused; re-registering retires the old.
        with pytest.raises(StagingError, match="are not its staging ring"):
            table.register(1, "zz", ring.capacity, [prefix + "r9-zz-s0"], b"id")
        daemon_ring.busy.add(1)
        table.retire_owner(b"id")
        assert list_segments(prefix)  # a save is still in flight: kept
        daemon_ring.busy.clear()
        table.collect()
        assert list_segments(prefix) == []  # the daemon unlinked what it owned
    finally:
        ring.close(unlink=True)
        table.release_all()


def test_items_larger_than_the_ring_are_stored_as_chunks(prefix, tmp_path):
    """A save four times the ring streams through it: items larger than the ring become chunks,
    the producer waits for the writer to free space, and the checkpoint loads bit-exact."""
    w = torch.randn(1 << 20)  # 4 MiB, the ring holds 1 MiB
    split = split_state_dict({"w": ShardedTensor.from_rank_offsets("w", w), "step": 1})
    items = split_large_items(plan_save(split, 0), 1 << 20)
    assert len(items) == 8 and all(i.record.sizes == (1 << 17,) for i in items)
    placements, _ = place(items)
    ring = StagingRing.create(prefix, 0, capacity=1 << 20, timeout_s=30)
    table = RingTable(prefix)
    try:
        daemon_ring = table.register(0, ring.generation, ring.capacity, ring.names, b"id")
        block, start = ring.claim(placements)
        seal = start_block(ring, block)
        req = WriteRequest(
            step=1, rank=0, records=[i.record for i in items], placements=placements, common=None, ring_start=start
        )
        wait = SnapshotWait.open(0, os.getpid(), seal, block_offset(block))
        with ThreadPoolExecutor(1) as writer:  # the daemon drains while this thread produces
            written = writer.submit(
                write_rank_file, PosixDataTarget(tmp_path, 0, open, False), daemon_ring.map, req, True, wait, 30
            )
            waited = copy_inline(ring, start, block, items, placements, seal)
            stored, _ = written.result(timeout=60)
        assert waited > 0  # it really had to wait for room
        finalize(tmp_path, stored, serialize_common(split.common))
        out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(1 << 20))}, tmp_path)
        assert torch.equal(out["w"], w)
    finally:
        ring.close(unlink=True)
        table.release_all()


def test_a_device_tensor_larger_than_the_ring_is_split_where_it_is():
    """Its chunks stay views of the device tensor (copied by DMA like any CUDA item), never one
    synchronous pageable copy of the whole tensor to the host inside save(); a strided one is made
    contiguous on its device. The meta device stands in for CUDA: the split is device-agnostic,
    and tests/integration/test_cuda_staging.py saves such a tensor on a GPU."""
    from ckptd.format.items import PlannedItem

    for base in (torch.empty(1 << 20, device="meta"), torch.empty(1 << 10, 1 << 10, device="meta").t()):
        split = split_state_dict({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(base.shape))})
        (item,) = plan_save(split, 0)
        items = split_large_items([PlannedItem(item.record, base)], 1 << 20)
        assert len(items) == 8 and all(i.payload.device.type == "meta" for i in items)
        assert sum(i.payload.numel() for i in items) == base.numel()


def test_every_producer_gives_up_with_the_mark_its_failure_calls_for():
    # A full /dev/shm, whether a rank's write (SharedMemoryFullError) or a child's pwrite (ENOSPC)
    # hit it, is NO_ROOM: the daemon then says so; anything else, or no failure, is ABANDONED.
    assert give_up_mark(SharedMemoryFullError("full")) == NO_ROOM
    assert give_up_mark(OSError(errno.ENOSPC, "No space left on device")) == NO_ROOM
    assert give_up_mark(OSError(errno.EIO, "I/O error")) == ABANDONED
    assert give_up_mark(RingFull("no room")) == ABANDONED
    assert give_up_mark(StagingError("copy failed")) == ABANDONED
    assert give_up_mark(None) == ABANDONED


def test_a_failed_ring_write_is_told_as_a_full_dev_shm_only_when_it_is(tmp_path):
    # Every OSError of a rank's write was a SharedMemoryFullError ("free /dev/shm"), an EIO too.
    seg = ShmSegment.create(f"ckptd-test-full-{secrets.token_hex(3)}", 1 << 16)
    try:
        full = seg.write_failed(OSError(errno.ENOSPC, "No space left on device"), 4096)
        other = seg.write_failed(OSError(errno.EIO, "Input/output error"), 4096)
        assert isinstance(full, SharedMemoryFullError) and give_up_mark(full) == NO_ROOM
        assert not isinstance(other, SharedMemoryFullError) and give_up_mark(other) == ABANDONED
        assert "Input/output error" in str(other) and "/dev/shm has" not in str(other)
    finally:
        seg.close()
        seg.unlink()


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == address for line in f)


def test_a_closed_ring_map_stays_mapped_while_a_view_of_it_is_held(tmp_path):
    """An upload may hold a part lent from the ring past its request's timeout, after the ring was
    released: the data region is unmapped only once the last view is let go (unmapping under a held
    view crashed the daemon when the client touched it)."""
    capacity = 1 << 16
    with open(tmp_path / "ring", "wb+") as f:
        f.truncate(HEADER_NBYTES + capacity)
        ring = RingMap(f.fileno(), capacity)
    address = ring.address
    held = ring.view(capacity - 4, 8)[2:]  # a slice of a view that wraps around, as a client keeps it
    held[:] = b"abcdef"
    ring.close()
    assert _mapped(address)
    assert bytes(held) == b"abcdef"
    del held
    assert not _mapped(address)

    fd = os.open(tmp_path / "ring", os.O_RDWR)
    unheld = RingMap(fd, capacity)
    os.close(fd)
    address = unheld.address
    unheld.view(0, 8)
    unheld.close()
    assert not _mapped(address)


class _Still:
    running = True


class _Ring:
    """A staging ring's surface that RankRing.drop uses, recording what happened to it."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self.segment = self

    def unlink(self) -> None:
        self.done.append("unlinked")

    def close(self, unlink: bool) -> None:
        self.done.append(f"closed, unlink={unlink}")


@pytest.mark.parametrize("writer", ["device snapshot", "lazy copier", None])
def test_a_ring_a_producer_still_writes_into_is_never_unmapped(writer):
    """The daemon was lost while a device snapshot's thread (or the lazy copier) still wrote into
    the ring: dropping it only unlinks its name; the mapping (and its pinned chunks, under a DMA
    maybe) stays for that write. Before, it was unmapped, and the write could land in whatever
    reused the memory or the descriptor."""
    from ckptd.client.rankring import RankRing
    from ckptd.staging.lazy import LazyCopier

    ring = RankRing(0, 1, "ckptd-test-", ckptd.CkptdConfig(), link=None)  # type: ignore[arg-type]
    ring.current = fake = _Ring()  # type: ignore[assignment]
    if writer == "device snapshot":
        ring.device_snapshots = [_Still()]  # type: ignore[list-item]
    elif writer == "lazy copier":
        ring.lazy = LazyCopier(0, 1.0)
        ring.lazy._handed = [SimpleNamespace(decided=threading.Event())]  # type: ignore[list-item]  # undecided
    ring.drop(unlink=True)
    assert ring.current is None
    assert fake.done == (["unlinked"] if writer else ["closed, unlink=True"])


def test_the_pieces_of_a_split_item_keep_its_watch_only_while_they_are_views_of_it():
    """A lazy save compares the watched DTensor's counter at the fence: pieces of a strided tensor
    are a copy taken in save(), which a later write does not reach, so they watch nothing (before,
    such a write failed a save whose bytes were consistent)."""
    from dataclasses import replace

    watched = torch.zeros(1)
    split = split_state_dict({"w": ShardedTensor.from_rank_offsets("w", torch.randn(512, 512))})
    (item,) = plan_save(split, 0)
    views = split_large_items([replace(item, watch=watched)], 1 << 18)
    strided = split_large_items([replace(item, payload=item.payload.t(), watch=watched)], 1 << 18)
    assert len(views) > 1 and all(p.watch is watched for p in views)
    assert len(strided) > 1 and all(p.watch is None for p in strided)


def test_a_release_of_a_control_block_no_ring_has_is_ignored(prefix, caplog):
    """A WRITE_DONE naming a block out of range went into the free list, and a later save's claim
    of it failed with a bare error."""
    from ckptd.format.items import PlannedItem
    from ckptd.format.records import BYTES, ItemRecord
    from ckptd.staging.rankside import place
    from ckptd.staging.ring import BLOCKS

    ring = StagingRing.create(prefix, 0, capacity=1 << 20, timeout_s=30)
    try:
        ring.release(BLOCKS + 7)
        ring.release(-1)
        assert "released control block 39, which no ring has" in caplog.text
        blocks = []
        for _ in range(BLOCKS):
            placements, _ = place([PlannedItem(ItemRecord(fqn="o", kind=BYTES, rank=0), b"x")])
            blocks.append(ring.claim(placements)[0])
        assert sorted(blocks) == list(range(BLOCKS)) and not ring.has_free_block()
    finally:
        ring.close(unlink=True)


def test_a_ring_replaced_between_its_check_and_its_mapping_is_refused(prefix, monkeypatch):
    """The daemon checks a rank's ring file, then maps it again by name for the writers: a file put
    in its place in between (shorter: a writer's read faults, SIGBUS, and ends the daemon) was
    mapped unchecked."""
    from ckptd.daemon.rings import attach_ring

    ring = StagingRing.create(prefix, 0, capacity=1 << 20, timeout_s=30)
    name = ring.names[0]
    attach = ShmSegment.attach

    def replaced_meanwhile(name_: str, nbytes: int) -> ShmSegment:
        segment = attach(name_, nbytes)
        path = SHM_DIR / name_
        path.unlink()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
        return segment

    monkeypatch.setattr(ShmSegment, "attach", replaced_meanwhile)
    try:
        with pytest.raises(StagingError, match="was replaced or resized while it was being mapped"):
            attach_ring(name, ring.capacity)
    finally:
        ring.close(unlink=True)
