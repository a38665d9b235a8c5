"""Copy-on-write snapshots (ckptd.staging.fork) into a staging ring (ckptd.staging.ring), and the
daemon's watch of them (ckptd.daemon.snapshot).

Real forked processes and a real /dev/shm ring; no daemon needed at this level (the integration
tests run the whole path with the daemon).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ckptd.daemon.rings import RingTable
from ckptd.daemon.snapshot import SnapshotWait
from ckptd.errors import StagingError
from ckptd.format.items import PlannedItem
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.staging.children import SnapshotChildren
from ckptd.staging.devcopy import InlineProducer
from ckptd.staging.devsnap import DeviceSnapshotProducer
from ckptd.staging.fork import child_copies, fork_snapshot, fork_started, reap
from ckptd.staging.lazy import LazyCopier
from ckptd.staging.producer import Claim, Producer, process_alive, start_block
from ckptd.staging.rankside import StagingRing, bytes_view, place
from ckptd.staging.ring import ABANDONED, SEAL_NBYTES, block_offset, span
from ckptd.staging.segment import unlink_segments


@pytest.fixture
def rings():
    """A rank's ring of 8 MiB, and the daemon's mapping of it."""
    prefix = f"ckptd-unit{secrets.token_hex(3)}-n0-"
    ring = StagingRing.create(prefix, 0, 8 << 20, timeout_s=30)
    table = RingTable(prefix)
    daemon_ring = table.register(0, ring.generation, ring.capacity, ring.names, b"id")
    yield ring, daemon_ring.map
    ring.close(unlink=False)
    table.release_all()
    assert not unlink_segments(prefix)


def _items(tensors: list[torch.Tensor], blob: bytes) -> list[PlannedItem]:
    items = [
        PlannedItem(
            ItemRecord(
                fqn=f"t{i}",
                kind=TENSOR,
                rank=0,
                dtype="float32",
                global_shape=tuple(t.shape),
                offsets=(0,) * t.dim(),
                sizes=tuple(t.shape),
            ),
            t,
        )
        for i, t in enumerate(tensors)
    ]
    items.append(PlannedItem(ItemRecord(fqn="obj", kind=BYTES, rank=0), blob))
    return items


@pytest.mark.timeout(60)
def test_child_copies_the_values_at_fork_time(rings):
    ring, dring = rings
    tensors = [torch.randn(1000), torch.randn(256, 1024), torch.randn(0)]
    expected = [t.clone() for t in tensors]
    items = _items(tensors, b"pickled object bytes")
    placements, nbytes = place(items)
    found = child_copies(items, placements)
    assert found is not None
    block, start = ring.claim(placements)
    snap = fork_snapshot(ring, start, block, found[0], nice=0, daemon_pid=os.getpid())
    for t in tensors:
        t.fill_(float("nan"))  # training overwrites right after save() returned
    wait = SnapshotWait.open(0, snap.pid, snap.seal, snap.seal_offset)
    for p in placements:  # as the daemon's writer does: each item once the child has copied it
        wait.wait_for(dring, start + p.offset + p.nbytes, timeout_s=30)
        assert wait.progress(dring) >= start + p.offset + p.nbytes
    wait.wait(dring, timeout_s=30)
    assert wait.progress(dring) == start + span(p.offset + p.nbytes for p in placements) and wait.sealed(dring)
    assert reap([snap.pid], block=True) == []
    for p, ref in zip(placements, expected):
        assert torch.equal(bytes_view(dring.view(start + p.offset, p.nbytes), torch.float32, ref.shape), ref)
    assert bytes(dring.view(start + placements[-1].offset, placements[-1].nbytes)) == b"pickled object bytes"


@pytest.mark.timeout(60)
def test_a_save_bigger_than_the_ring_streams_through_it_and_wraps(rings):
    """The child waits for room; the consumer frees it item by item; items that cross the end
    of the ring are contiguous in the daemon's double mapping."""
    ring, dring = rings
    tensors = [torch.randn(3 << 18) for _ in range(8)]  # 3 MiB each, 24 MiB through an 8 MiB ring
    items = _items(tensors, b"")[:-1]
    placements, _ = place(items)
    block, start = ring.claim(placements)
    snap = fork_snapshot(ring, start, block, child_copies(items, placements)[0], nice=0, daemon_pid=os.getpid())
    wait = SnapshotWait.open(0, snap.pid, snap.seal, snap.seal_offset)
    wrapped = 0
    for t, p in zip(tensors, placements):
        end = start + p.offset + p.nbytes
        wait.wait_for(dring, end, timeout_s=30)
        v = start + p.offset
        wrapped += v % dring.capacity + p.nbytes > dring.capacity
        assert torch.equal(bytes_view(dring.view(v, p.nbytes), torch.float32, t.shape), t)
        dring.set_consumed(end)  # written: the child may reuse the space
    wait.wait(dring, timeout_s=30)
    assert reap([snap.pid], block=True) == [] and wrapped >= 1


@pytest.mark.timeout(60)
def test_non_plain_shards_are_not_forked():
    strided = torch.randn(8, 8).t()  # not contiguous: the trainer produces it
    items = _items([strided], b"")
    placements, _ = place(items)
    assert child_copies(items, placements) is None


def test_memory_torch_did_not_allocate_is_forked_only_where_it_is_mapped_private(tmp_path):
    """Tensors over a np.memmap or over multiprocessing.shared_memory are mapped shared, which
    ``is_shared()`` does not know: a fork child copied the trainer's later writes to them (a torn
    save). Those torch did not allocate but that are private (numpy's heap, a MAP_PRIVATE file
    mapping) are still copied by the child."""
    import mmap
    from multiprocessing import shared_memory

    import numpy as np

    def forked(t: torch.Tensor) -> bool:
        items = _items([t], b"")
        return child_copies(items, place(items)[0]) is not None

    memmap = np.memmap(tmp_path / "m", dtype=np.float32, mode="w+", shape=(1024,))
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert not forked(torch.from_numpy(memmap))
        assert not forked(torch.frombuffer(shm.buf, dtype=torch.float32))
        private = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
        assert forked(torch.frombuffer(private, dtype=torch.float32))
        assert forked(torch.from_numpy(np.zeros(1024, dtype=np.float32)))
        assert forked(torch.randn(1024))
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.timeout(60)
def test_a_child_that_dies_before_sealing_fails_the_save_and_frees_its_space(rings):
    ring, dring = rings
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # exits without copying or sealing: as if killed half-way
    seal = start_block(ring, 3)
    wait = SnapshotWait.open(3, pid, seal, block_offset(3))
    with pytest.raises(StagingError, match=f"rank 3: snapshot process {pid} exited before it had copied"):
        wait.wait_for(dring, 100, timeout_s=30)  # nothing was copied: no progress, no seal
    wait = SnapshotWait.open(3, pid, seal, block_offset(3))
    with pytest.raises(StagingError, match=f"rank 3: snapshot process {pid} exited before it had copied"):
        wait.wait(dring, timeout_s=30)
    reap([pid], block=True)
    # Already reaped when the SAVE arrives (its trainer died): the seal alone decides.
    gone = SnapshotWait.open(3, pid, seal, block_offset(3))
    with pytest.raises(StagingError, match="exited before"):
        gone.wait(dring, timeout_s=1)
    # The failed write gives the save's ring space back, so later saves are not stuck.
    gone = SnapshotWait.open(3, pid, seal, block_offset(3))
    assert gone.drain(dring, 4096, timeout_s=5) and dring.consumed() >= 4096


@pytest.mark.timeout(60)
def test_a_child_that_hangs_times_out(rings):
    ring, dring = rings
    pid = os.fork()
    if pid == 0:
        time.sleep(30)  # the hang under test (killed below), not a wait for anything
        os._exit(0)
    try:
        wait = SnapshotWait.open(1, pid, start_block(ring, 0), block_offset(0))
        t0 = time.monotonic()
        with pytest.raises(StagingError, match="did not finish copying within 0.3 s"):
            wait.wait(dring, timeout_s=0.3)
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, 9)
        reap([pid], block=True)


def test_malformed_snapshot_requests_are_refused():
    for pid, seal, at in (
        (0, b"x" * SEAL_NBYTES, block_offset(0)),
        (os.getpid(), b"short", block_offset(0)),
        (os.getpid(), b"x" * SEAL_NBYTES, block_offset(0) + 1),
        (os.getpid(), b"x" * SEAL_NBYTES, 0),
    ):
        with pytest.raises(StagingError, match="malformed snapshot"):
            SnapshotWait.open(0, pid, seal, at)


def _fork_stuck_in(monkeypatch, stuck: set[int]) -> list[int]:
    """Make the children of the forks numbered in ``stuck`` (1 = the first) hang where CPython
    before 3.12 can deadlock: inside ``os.fork()``, before the child runs a line of its caller's
    code (CPython gh-112275). Returns the pids forked, in order."""
    real = os.fork
    pids: list[int] = []

    def fork() -> int:
        n = len(pids) + 1
        pid = real()
        if pid == 0 and n in stuck:
            time.sleep(60)  # does not return from "os.fork()" before the parent kills it
            os._exit(1)
        pids.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    return pids


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.timeout(60)
def test_a_child_stuck_before_it_starts_is_killed_and_forked_again(monkeypatch, caplog):
    pids = _fork_stuck_in(monkeypatch, {1})
    pid = fork_started(lambda: os._exit(7), start_timeout_s=0.5)
    assert pid is not None and pids == [pids[0], pid]
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7  # the second child ran
    assert _gone(pids[0])  # the stuck one was killed and reaped
    assert "did not start within 0.5 s (try 1 of 3" in caplog.text


@pytest.mark.timeout(60)
def test_when_no_child_starts_there_is_no_snapshot_and_no_process_left(monkeypatch):
    pids = _fork_stuck_in(monkeypatch, {1, 2})
    assert fork_started(lambda: os._exit(0), start_timeout_s=0.3, tries=2) is None
    assert len(pids) == 2 and all(_gone(p) for p in pids)


@pytest.mark.timeout(60)
def test_a_child_whose_parent_is_interrupted_while_it_starts_is_killed(monkeypatch):
    """A KeyboardInterrupt while the parent waited for the child's word left the child running,
    untracked, while the save's ring range it copies into was handed back to the next save."""
    import gc
    import signal as signals

    pids = _fork_stuck_in(monkeypatch, {1})
    before = signals.signal(signals.SIGALRM, signals.default_int_handler)
    # No collection while it waits: an interrupt that lands in a gc callback (hypothesis's, in
    # this process) is swallowed there and printed as an unraisable exception.
    gc.disable()
    signals.setitimer(signals.ITIMER_REAL, 0.2)  # a Ctrl-C while the parent waits
    try:
        with pytest.raises(KeyboardInterrupt):
            fork_started(lambda: os._exit(0), start_timeout_s=30)
    finally:
        signals.setitimer(signals.ITIMER_REAL, 0)
        signals.signal(signals.SIGALRM, before)
        gc.enable()
    assert len(pids) == 1 and _gone(pids[0])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_forks_while_threads_create_thread_states_all_start():
    """The real deadlock: C threads (here pthreads calling a ctypes callback, which creates and
    deletes a Python thread state each time, as a C++ library thread calling into Python does)
    hold the runtime's thread-state lock at some forks. On Python 3.11 about 2 in 1,000 plain
    forks leave a child stuck for good; every fork_started() child starts."""
    import ctypes
    import sys
    import threading

    libc = ctypes.CDLL(None)
    callback = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda _: None)
    stop = threading.Event()

    def churn() -> None:
        tid = ctypes.c_ulong()
        while not stop.is_set():
            libc.pthread_create(ctypes.byref(tid), None, callback, None)
            libc.pthread_join(tid, None)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    threads = [threading.Thread(target=churn, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        for _ in range(1000):
            pid = fork_started(lambda: os._exit(0))
            assert pid is not None
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        sys.setswitchinterval(interval)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fork", "lazy", "inline", "device"])
def test_every_producer_kind_produces_and_seals_the_claimed_save(rings, kind):
    # The producers behind one type: started on a claim, told that the daemon took the save
    # (after_ack), each leaves the values of save() time in the ring and the seal the SAVE announced.
    # A device snapshot (ckptd.staging.devsnap; on host tensors it needs no GPU) is taken when its
    # producer is made, so training may overwrite the tensors before its thread even started.
    ring, dring = rings
    tensors = [torch.randn(1000), torch.randn(256, 1024)]
    expected = [t.clone() for t in tensors]
    items = _items(tensors, b"pickled object bytes")
    placements, _ = place(items)
    block, start = ring.claim(placements)
    claim = Claim(step=1, block=block, start=start, items=items, placements=placements)
    children, copier = SnapshotChildren(0), LazyCopier(0, timeout_s=30)
    producer: Producer | None
    if kind == "fork":
        producer, waited_s = children.fork(ring, claim, os.getpid(), time.sleep)
        assert waited_s >= 0
    elif kind == "lazy":
        producer = copier.start(ring, claim)
    elif kind == "inline":
        producer = InlineProducer(ring, claim, pin_timeout_s=30)
    else:
        producer = DeviceSnapshotProducer(ring, claim, pin_timeout_s=30)
        for t in tensors:
            t.fill_(float("nan"))  # training goes on before the producer's thread started
    assert producer is not None
    snap = producer.snapshot
    assert producer.after_ack() >= 0
    copier.fence()  # a lazy save is sealed once fenced unchanged
    for t in tensors:
        t.fill_(float("nan"))  # training goes on
    wait = SnapshotWait.open(0, snap.pid, snap.seal, snap.seal_offset)
    wait.wait(dring, timeout_s=30)
    for p, ref in zip(placements, expected):
        assert torch.equal(bytes_view(dring.view(start + p.offset, p.nbytes), torch.float32, ref.shape), ref)
    if isinstance(producer, DeviceSnapshotProducer):
        assert producer.join(30) and not producer.running
    children.close(time.monotonic() + 30)
    assert len(children) == 0 and copier.stop(time.monotonic() + 5)


@pytest.mark.timeout(60)
def test_a_cancelled_fork_producer_has_stopped_writing_when_cancel_returns(rings):
    ring, _ = rings
    items = _items([torch.randn(4096)], b"x")
    placements, _ = place(items)
    block, start = ring.claim(placements)
    claim = Claim(step=1, block=block, start=start, items=items, placements=placements)
    children = SnapshotChildren(0)
    producer, _ = children.fork(ring, claim, os.getpid(), time.sleep)
    assert producer is not None
    producer.cancel()  # the daemon never took the save: its range may be given back now
    with pytest.raises(ChildProcessError):
        os.waitpid(producer.snapshot.pid, os.WNOHANG)  # exited and reaped already
    assert len(children) == 0


def _oversized_lazy_save(
    ring: StagingRing, copier: LazyCopier, daemon_pid: int | None = None
) -> tuple[Producer, Claim]:
    """A lazy save of 12 MiB claimed in the 8 MiB ring (it streams: the daemon must free room)."""
    items = _items([torch.randn(1 << 20) for _ in range(3)], b"x")
    placements, _ = place(items)
    block, start = ring.claim(placements)
    claim = Claim(step=1, block=block, start=start, items=items, placements=placements)
    return copier.start(ring, claim, daemon_pid=daemon_pid), claim


@pytest.mark.timeout(60)
def test_a_cancelled_lazy_producer_drops_its_save_unread(rings):
    """A lazy save the daemon refused is dropped before the copier thread sees it: a save larger
    than the ring would otherwise be copied until the ring is full and wait for room nobody frees
    (``snapshot_timeout_s``, then a StagingError in place of the refusal)."""
    ring, _ = rings
    copier = LazyCopier(0, timeout_s=30.0)
    producer, claim = _oversized_lazy_save(ring, copier)
    producer.cancel()
    assert copier._thread is None and not copier._pending  # never handed over, nothing left to fence
    ring.unclaim(claim.block, claim.start, claim.placements)
    copier.fence()
    assert copier.stop(time.monotonic() + 5)


@pytest.mark.timeout(60)
def test_a_lazy_copy_waiting_for_room_gives_up_at_once_when_the_daemon_is_gone(rings):
    """A lazy save larger than the ring waits for the daemon to free room; when the daemon is lost
    (RankRing.quiesce(daemon_gone=True)) that wait gives up at once and the save is abandoned,
    instead of holding the training thread for snapshot_timeout_s."""
    ring, _ = rings
    copier = LazyCopier(0, timeout_s=45.0)
    producer, _ = _oversized_lazy_save(ring, copier)
    producer.after_ack()  # the copier fills the ring, then waits for room nobody frees
    copier.wait_all(daemon_gone=True)
    assert not copier._handed and not copier._daemon_gone.is_set()
    assert copier.stop(time.monotonic() + 5)


@pytest.mark.timeout(60)
def test_a_lazy_copy_waiting_for_room_gives_up_when_its_daemon_process_dies(rings):
    """The node daemon dies while the lazy copier waits for room only it frees: the copier watched
    no process (it gave up only once the training thread, after its fence, had dropped the daemon),
    so the fence waited out snapshot_timeout_s. Now it gives up as the daemon's process is gone: a
    zombie nobody reaped yet is gone too (the parent of a detached daemon reaps it when it will)."""
    ring, dring = rings
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        copier = LazyCopier(0, timeout_s=45.0)
        producer, claim = _oversized_lazy_save(ring, copier, daemon_pid=daemon.pid)
        producer.after_ack()  # the copier fills the ring, then waits for room nobody frees
        time.sleep(0.2)
        daemon.kill()  # not reaped: a zombie
        t0 = time.monotonic()
        copier.fence()
        assert time.monotonic() - t0 < 10  # not snapshot_timeout_s (45 s)
        assert not process_alive(daemon.pid)()
        copier.wait_all()
        assert dring.progress(claim.block) == ABANDONED
        assert copier.stop(time.monotonic() + 5)
    finally:
        daemon.kill()
        daemon.wait()


@pytest.mark.timeout(60)
def test_a_lazy_copy_still_running_when_close_gives_up_stops_before_its_next_item(rings, monkeypatch):
    """close() abandons a lazy save not copied by its deadline: the copier went on copying it to the
    end, reading the trainer's tensors (and issuing device copies) after close() returned."""
    ring, _ = rings
    produce = StagingRing.produce
    copied: list[int] = []

    def slow(self, item, p, v):  # each item takes a while: the save is copying at the deadline
        time.sleep(0.05)
        copied.append(v)
        return produce(self, item, p, v)

    monkeypatch.setattr(StagingRing, "produce", slow)
    items = _items([torch.randn(256) for _ in range(60)], b"x")
    placements, _ = place(items)
    block, start = ring.claim(placements)
    copier = LazyCopier(0, timeout_s=30.0)
    copier.start(ring, Claim(step=1, block=block, start=start, items=items, placements=placements)).after_ack()
    assert copier.stop(time.monotonic() + 0.2)  # the thread stops soon after the deadline
    n = len(copied)
    time.sleep(0.3)
    assert len(copied) == n < len(items)


@pytest.mark.timeout(60)
def test_waiting_for_the_lazy_copier_waits_until_a_fenced_save_is_sealed(rings, monkeypatch):
    """wait_all() (before the ring is unmapped: the daemon lost, the Checkpointer closing) returns
    only once the copier wrote the seal of every save handed to it, also of one fenced before (a
    CUDA save is fenced once its copies are issued, then lands and is sealed by the copier)."""
    ring, dring = rings
    decide = LazyCopier._decide
    monkeypatch.setattr(LazyCopier, "_decide", lambda self, job: (time.sleep(0.5), decide(self, job)))
    items = _items([torch.randn(4096)], b"x")
    placements, _ = place(items)
    block, start = ring.claim(placements)
    copier = LazyCopier(0, timeout_s=30.0)
    producer = copier.start(ring, Claim(step=1, block=block, start=start, items=items, placements=placements))
    producer.after_ack()
    copier.fence()  # the save is decided on the training thread; the copier seals it after
    copier.wait_all()
    snap = producer.snapshot
    SnapshotWait.open(0, snap.pid, snap.seal, snap.seal_offset).wait(dring, timeout_s=0.01)  # sealed already
    assert copier.stop(time.monotonic() + 5)


@pytest.mark.timeout(30)
def test_an_inline_save_waiting_for_room_gives_up_once_the_daemon_is_gone(rings):
    """save() itself producing a save larger than the ring (CUDA tensors, snapshot="copy") waits
    for the node daemon to free room; a daemon that died frees none, so the wait ends at once
    with the reason, not after snapshot_timeout_s (60 s here)."""
    ring, _ = rings
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # a pid that no longer runs: the daemon, killed
    items = _items([torch.randn(1 << 20) for _ in range(3)], b"x")  # 12 MiB through an 8 MiB ring
    placements, _ = place(items)
    block, start = ring.claim(placements)
    claim = Claim(step=1, block=block, start=start, items=items, placements=placements)
    producer = InlineProducer(ring, claim, 60.0, daemon_pid=gone.pid)
    with pytest.raises(StagingError, match="the node daemon that frees it is gone"):
        producer.after_ack()


@pytest.mark.timeout(60)
def test_an_inline_save_copies_what_fits_before_the_save_is_sent_and_the_rest_after(rings):
    # save() itself issues the copies of the items the ring has room for before the SAVE is
    # sent (on CUDA they run during its round trip), and never waits there for room: the daemon
    # drains a save only once it has its SAVE, so an item that does not fit yet is copied after
    # the acknowledgement (a wait before the SAVE would never end).
    ring, dring = rings
    fits, later = torch.randn(1 << 20), torch.randn(1 << 20)  # 4 MiB each
    items = _items([fits, later], b"x")
    placements, _ = place(items)
    dring.set_consumed(0)
    ring.next_start = 3 << 20  # a previous save holds 3 MiB the daemon has not consumed yet
    block, start = ring.claim(placements)
    claim = Claim(step=1, block=block, start=start, items=items, placements=placements)
    producer = InlineProducer(ring, claim, pin_timeout_s=30)
    assert torch.equal(
        bytes_view(dring.view(start + placements[0].offset, placements[0].nbytes), torch.float32, fits.shape), fits
    )
    assert producer._issued == 1  # the second tensor does not fit until the daemon consumes
    dring.set_consumed(start)  # the daemon drains the previous save, then this one's first item
    drain = threading.Timer(0.2, dring.set_consumed, args=(start + placements[1].offset,))
    drain.start()
    producer.after_ack()
    drain.join()
    got = bytes_view(dring.view(start + placements[1].offset, placements[1].nbytes), torch.float32, later.shape)
    assert torch.equal(got, later)


@pytest.mark.timeout(60)
def test_a_stopped_device_snapshot_waiting_for_ring_space_gives_up_and_marks_its_save(rings):
    # The daemon is gone (or the Checkpointer closes): a device snapshot whose thread waits for
    # ring space the daemon will never free gives up when stopped, marks its save as given up
    # (the daemon, were it there, fails the save) and its thread ends: nothing then writes into
    # the ring about to be unmapped.
    ring, dring = rings
    big = torch.randn(3 << 20)  # 12 MiB: more than the 8 MiB ring holds at once
    items = _items([big], b"x")
    placements, _ = place(items)
    block, start = ring.claim(placements)
    claim = Claim(step=1, block=block, start=start, items=items, placements=placements)
    producer = DeviceSnapshotProducer(ring, claim, pin_timeout_s=30)
    producer.after_ack()
    time.sleep(0.2)
    assert producer.running  # waiting for the daemon to consume what it wrote
    producer.stop()
    assert producer.join(10)
    assert dring.progress(block) == ABANDONED


def test_a_snapshot_child_keeps_only_the_rings_descriptor(tmp_path):
    """The child closes every descriptor it inherited but the ring's, even one numbered above a
    lowered limit, and its stdio reads and writes /dev/null (a launcher reading the trainer's
    output must see it end when the trainer exits)."""
    from ckptd.staging.fork import _keep_only

    ring = os.open(tmp_path / "ring", os.O_RDWR | os.O_CREAT, 0o600)
    stray = os.open(tmp_path / "stray", os.O_RDWR | os.O_CREAT, 0o600)
    high = os.dup2(stray, 900)
    pid = os.fork()
    if pid == 0:
        try:
            _keep_only(ring)
            left = {}
            for n in os.listdir("/proc/self/fd"):
                try:
                    left[n] = os.readlink(f"/proc/self/fd/{n}")
                except OSError:  # the listing's own descriptor, closed already
                    pass
            os.write(ring, json.dumps(left).encode())
        finally:
            os._exit(0)
    try:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        left = {int(n): path for n, path in json.loads((tmp_path / "ring").read_text()).items()}
        assert stray not in left and high not in left
        assert {left[n] for n in (0, 1, 2)} == {"/dev/null"} and left[ring] == str(tmp_path / "ring")
        assert set(left) == {0, 1, 2, ring}
    finally:
        for fd in (ring, stray, high):
            os.close(fd)


@pytest.mark.timeout(60)
def test_a_child_still_copying_after_its_save_failed_is_killed_before_its_space_is_freed(rings):
    """Freed while the child still ran, the space would be a later save's, and the child's late
    copies would land in that save's checkpoint."""
    ring, dring = rings
    pid = os.fork()
    if pid == 0:
        time.sleep(30)  # stalled (stopped, swapped out) before its next copy
        os._exit(0)
    try:
        wait = SnapshotWait.open(2, pid, start_block(ring, 2), block_offset(2), child=True)
        before = dring.consumed()
        assert wait.drain(dring, before + 4096, timeout_s=0.3)
        assert dring.consumed() == before + 4096 and not dring.frozen
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL  # killed: it writes no more
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        reap([pid], block=True)


@pytest.mark.timeout(60)
def test_without_pidfds_a_later_process_given_the_producers_pid_is_not_killed(rings):
    """Polling /proc (no pidfd_open), a drain took whatever process had the pid for the snapshot
    child, and SIGKILLed it."""
    from ckptd.daemon.snapshot import ExitWatch
    from ckptd.procid import start_ticks_of

    ring, dring = rings
    pid = os.fork()
    if pid == 0:
        time.sleep(30)  # not the snapshot child: a process that got its pid later
        os._exit(0)
    try:
        wait = SnapshotWait.open(2, pid, start_block(ring, 2), block_offset(2), child=True)
        wait.close()
        ticks = start_ticks_of(pid)
        assert ticks is not None
        wait.exit_watch, wait.start_ticks = ExitWatch.POLL, ticks - 1  # the child that had the pid
        before = dring.consumed()
        assert wait.drain(dring, before + 4096, timeout_s=0.2)  # that child is gone
        assert dring.consumed() == before + 4096
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # the other process still runs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        reap([pid], block=True)


@pytest.mark.timeout(60)
def test_a_rank_thread_still_copying_after_its_save_failed_freezes_the_ring(rings):
    """The rank's own process (a lazy or device copy's thread) cannot be killed: none of the
    ring's space is freed from then on, by this save or any later one."""
    ring, dring = rings
    wait = SnapshotWait.open(0, os.getpid(), start_block(ring, 1), block_offset(1))  # never sealed
    before = dring.consumed()
    assert not wait.drain(dring, before + 4096, timeout_s=0.2)
    assert "rank 0's snapshot producer (process" in dring.frozen and "CKPTD_SNAPSHOT_TIMEOUT_S" in dring.frozen
    dring.set_consumed(before + 8192)  # a later save's write
    assert dring.consumed() == before


@pytest.mark.timeout(60)
def test_a_rank_thread_that_produced_every_byte_frees_its_space_without_its_seal(rings):
    """A lazy copy done copying waits for the training loop's fence to seal; a drain that timed
    out on the seal froze the ring for good, though the copy writes into no space any more."""
    ring, dring = rings
    wait = SnapshotWait.open(0, os.getpid(), start_block(ring, 1), block_offset(1))  # never sealed
    before = dring.consumed()
    ring.writer.publish(1, before + 4096)  # every byte of the save produced
    assert wait.drain(dring, before + 4096, timeout_s=0.2)
    assert dring.consumed() == before + 4096 and not dring.frozen


@pytest.mark.timeout(60)
def test_a_child_that_times_out_before_its_seal_is_killed_by_the_drain_after_it(rings):
    """The wait for the seal times out; the drain after it must still see the child running (the
    wait used to close the watch, and the drain then took the child for gone and freed its space)."""
    ring, dring = rings
    pid = os.fork()
    if pid == 0:
        time.sleep(30)  # stalled before its seal
        os._exit(0)
    try:
        wait = SnapshotWait.open(2, pid, start_block(ring, 2), block_offset(2), child=True)
        with pytest.raises(StagingError, match="did not finish copying within 0.2 s"):
            wait.wait(dring, timeout_s=0.2)
        assert wait.drain(dring, dring.consumed() + 4096, timeout_s=0.2)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    finally:
        wait.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
        reap([pid], block=True)


def test_a_drain_frees_the_padding_before_the_item_being_produced():
    """Freed only up to what the producer published, the padding before the next item stayed
    taken, and a producer waiting for room for an item a few bytes short of the ring's capacity
    never got it: the drain waited out its timeout, then froze the ring. Only padding is freed
    ahead: a device copy publishes points inside an item, whose rest is not written yet."""
    from ckptd.daemon.snapshot import free_up_to

    # Items [4096, 4108), [4160, 8000), [8192, 9000): 52 and 192 bytes of padding after them.
    starts, ends = [4096, 4160, 8192], [4108, 8000, 9000]
    assert free_up_to(4060, starts, ends) == 4096  # the padding before the save's first item
    assert free_up_to(1000, starts, ends) == 1000  # more than padding: a range some producer may hold
    assert free_up_to(4108, starts, ends) == 4160  # the first item produced: its padding too
    assert free_up_to(4200, starts, ends) == 4200  # inside the second item: not past it
    assert free_up_to(8000, starts, ends) == 8000  # 192 bytes to the next item: no padding (< 64)
    assert free_up_to(9000, starts, ends) == 9000  # the last item produced
    assert free_up_to(5000, [], []) == 5000
