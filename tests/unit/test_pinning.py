"""Pinning a staging ring in the background (ckptd.staging.pinning) and splitting device-to-host
copies at pinned chunks (ckptd.staging.devcopy.ring_pieces).

The real ``cudaHostRegister`` cannot run without a GPU, so these tests give the pinner a
:class:`CountingRegistrar`: the one stand-in the project allows, because the registrar is the seam
through which every CUDA pinning call goes. It records each call (thread, address, bytes) and
checks what the driver would need; everything else is the real code: real ``/dev/shm`` segments,
real ``posix_fallocate``, real threads (tests/integration/test_ring_pinning.py: a real
Checkpointer and daemon; tests/integration/test_cuda_staging.py: the real registrar, on a GPU).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckptd.errors import StagingError
from ckptd.staging.devcopy import ring_pieces
from ckptd.staging.pinning import RingPinner
from ckptd.staging.ring import HEADER_NBYTES
from ckptd.staging.segment import ShmSegment, allocated_nbytes, new_generation

PAGE = 4096


class CountingRegistrar:
    """Stands in for CUDA's host registration (see the module docstring): records every call and
    refuses what cudaHostRegister would not take (unaligned or overlapping ranges, releasing
    what was never registered). ``fail_at``: the call number that fails; ``gate``: each register
    call waits for it (a slow driver)."""

    def __init__(self, fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, int, int, int]] = []  # (what, thread id, address, nbytes)
        self.live: dict[int, int] = {}
        self.fail_at = fail_at
        self.gate = gate
        self.lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        with self.lock:
            if self.fail_at is not None and len(self.registered()) == self.fail_at:
                raise StagingError("cudaHostRegister failed with CUDA error 2 (test)")
            if address % PAGE or nbytes % PAGE or nbytes <= 0:
                raise AssertionError(f"unaligned registration {address:#x}+{nbytes}")
            if any(a < address + nbytes and address < a + n for a, n in self.live.items()):
                raise AssertionError("overlapping registration")
            self.live[address] = nbytes
            self.calls.append(("register", threading.get_ident(), address, nbytes))

    def unregister(self, address: int) -> None:
        with self.lock:
            if address not in self.live:
                raise AssertionError(f"unregister of {address:#x}, never registered")
            del self.live[address]
            self.calls.append(("unregister", threading.get_ident(), address, 0))

    def registered(self) -> list[tuple[str, int, int, int]]:
        return [c for c in self.calls if c[0] == "register"]

    def registered_nbytes(self, thread: int | None = None) -> int:
        return sum(c[3] for c in self.registered() if thread is None or c[1] == thread)


@pytest.fixture
def segment():
    capacity = 10 * 64 * 1024 + 3 * PAGE  # not a whole number of chunks
    seg = ShmSegment.create(f"ckptd-test-pin-{new_generation()}", HEADER_NBYTES + capacity)
    yield seg, capacity
    seg.close()
    seg.unlink()


def _wait_done(pinner: RingPinner) -> None:
    deadline = time.monotonic() + 10
    while not pinner._done and time.monotonic() < deadline:
        time.sleep(0.005)


def test_the_pinner_allocates_and_registers_every_chunk_on_its_own_thread(segment):
    seg, capacity = segment
    reg = CountingRegistrar()
    chunk = 64 * 1024
    pinner = RingPinner(seg, HEADER_NBYTES, capacity, reg, chunk_nbytes=chunk).start()
    try:
        assert pinner.wait(capacity - 1, timeout_s=10)  # the last chunk: all of them, in order
        calls = reg.registered()
        assert len(calls) == pinner.chunks == 11
        data = seg.base.data_ptr() + HEADER_NBYTES
        assert [c[2] for c in calls] == [data + i * chunk for i in range(11)]  # in ring order
        assert reg.registered_nbytes() == capacity and max(c[3] for c in calls) == chunk
        assert {c[1] for c in calls} == {calls[0][1]} != {threading.get_ident()}  # one thread, not ours
        assert pinner.complete and all(pinner.pinned(at) for at in range(0, capacity, PAGE))
        # Allocated before registration: a full /dev/shm is an error there, never a SIGBUS here.
        assert allocated_nbytes(seg.fileno()) >= HEADER_NBYTES + capacity - PAGE
    finally:
        pinner.close()
    assert reg.live == {} and len(reg.calls) == 22  # every chunk unregistered again, once


def test_a_failed_registration_stops_pinning_and_keeps_what_was_pinned(segment):
    seg, capacity = segment
    chunk = 64 * 1024
    reg = CountingRegistrar(fail_at=3)
    pinner = RingPinner(seg, HEADER_NBYTES, capacity, reg, chunk_nbytes=chunk).start()
    try:
        assert pinner.wait(2 * chunk, timeout_s=10)
        t0 = time.monotonic()
        assert not pinner.wait(3 * chunk, timeout_s=10)  # never: False at once, no timeout
        assert not pinner.wait(capacity - 1, timeout_s=10)
        assert time.monotonic() - t0 < 5
        assert "CUDA error 2" in pinner.error and not pinner.complete
        assert [pinner.pinned(i * chunk) for i in range(5)] == [True, True, True, False, False]
    finally:
        pinner.close()
    assert reg.live == {}


def test_any_error_of_the_registrar_stops_pinning_with_a_warning_and_its_reason(segment, caplog):
    """A RuntimeError (torch.cuda.set_device, cudart()) killed the thread with a bare traceback:
    no reason recorded, no warning of ckptd's, CUDA saves then slow without a word."""
    seg, capacity = segment

    class Broken(CountingRegistrar):
        def register(self, address: int, nbytes: int) -> None:
            raise RuntimeError("CUDA error: invalid device ordinal")

    pinner = RingPinner(seg, HEADER_NBYTES, capacity, Broken(), chunk_nbytes=64 * 1024).start()
    try:
        assert not pinner.wait(0, timeout_s=10)
        assert pinner.error == "RuntimeError: CUDA error: invalid device ordinal"
        assert "pinning the staging ring stopped after 0 of" in caplog.text
    finally:
        pinner.close()


def test_closing_stops_pinning_after_the_chunk_under_way(segment):
    seg, capacity = segment
    gate = threading.Event()
    reg = CountingRegistrar(gate=gate)
    pinner = RingPinner(seg, HEADER_NBYTES, capacity, reg, chunk_nbytes=64 * 1024).start()
    time.sleep(0.05)  # the thread waits in its first registration
    closer = threading.Thread(target=pinner.close)
    closer.start()
    time.sleep(0.05)
    gate.set()
    closer.join(10)
    assert not closer.is_alive()
    assert len(reg.registered()) == 1 and reg.live == {}  # the one under way, released again


def test_waiting_for_a_chunk_is_bounded(segment):
    seg, capacity = segment
    gate = threading.Event()
    pinner = RingPinner(seg, HEADER_NBYTES, capacity, CountingRegistrar(gate=gate), chunk_nbytes=64 * 1024).start()
    try:
        with pytest.raises(StagingError, match="was not pinned within 0.1 s"):
            pinner.wait(0, timeout_s=0.1)
    finally:
        gate.set()
        pinner.close()


def test_running_says_whether_chunks_are_still_being_registered(segment):
    """What a save asks before taking a device snapshot (ckptd.staging.devsnap): true from start
    until every chunk is registered, the pinning failed or it was closed; never before start."""
    seg, capacity = segment
    gate = threading.Event()
    pinner = RingPinner(seg, HEADER_NBYTES, capacity, CountingRegistrar(gate=gate), chunk_nbytes=64 * 1024)
    assert not pinner.running
    pinner.start()
    try:
        assert pinner.running
        gate.set()
        assert pinner.wait(capacity - 1, timeout_s=10)
        _wait_done(pinner)
        assert not pinner.running and pinner.complete
    finally:
        pinner.close()
    failing = RingPinner(seg, HEADER_NBYTES, capacity, CountingRegistrar(fail_at=1), chunk_nbytes=64 * 1024).start()
    try:
        assert not failing.wait(capacity - 1, timeout_s=10)
        assert not failing.running and failing.error
    finally:
        failing.close()
    gate = threading.Event()
    stopped = RingPinner(seg, HEADER_NBYTES, capacity, CountingRegistrar(gate=gate), chunk_nbytes=64 * 1024).start()
    closer = threading.Thread(target=stopped.close)
    closer.start()  # waits for the registration under way
    deadline = time.monotonic() + 10
    while stopped.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not stopped.running  # closing: no longer pinning, though a registration is still under way
    gate.set()
    closer.join(10)


@pytest.mark.parametrize("capacity,chunk", [(1 << 20, 1 << 16), (5 * 4096, 3 * 4096), (1 << 20, 1 << 20)])
def test_ring_pieces_never_span_a_chunk_or_the_ring_end(capacity, chunk):
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        v = int(torch.randint(0, 4 * capacity, (1,), generator=gen))
        n = int(torch.randint(1, capacity + 1, (1,), generator=gen))
        pieces = ring_pieces(v, n, capacity, chunk)
        assert [p[0] for p in pieces] == [sum(p[2] for p in pieces[:i]) for i in range(len(pieces))]
        assert sum(p[2] for p in pieces) == n
        for src, at, k in pieces:
            assert at == (v + src) % capacity  # where the byte lives in the ring
            assert at // chunk == (at + k - 1) // chunk and at + k <= capacity  # one chunk, no wrap
    assert ring_pieces(0, 0, capacity, chunk) == []
