"""Lazy snapshots: ``save()`` returns after planning; the copies into the slot run behind training.

Parameters and optimizer state do not change between one optimizer step and the next: forward and
backward only read them. A lazy save (``snapshot="lazy"``) therefore copies them into its staging
slot while forward and backward run, and only the next optimizer step has to wait, for what is not
copied yet: :meth:`ckptd.Checkpointer.before_update` (or ``Checkpointer.attach(optimizer)``, which
calls it from the optimizer's step pre-hook).

- CPU tensors: a copier thread copies item by item (``pwrite``, GIL released), publishing its
  progress in the slot after each item and a seal after the last one: the protocol of fork
  snapshots (:mod:`ckptd.staging.fork`), so the daemon writes each item as soon as it is copied
  and fails the save if the seal never comes. ``before_update()`` waits for the copier.
- CUDA tensors: ``save()`` enqueues the device-to-host copies on a side stream that first waits
  for the current stream, with an event per item; the copier thread waits on the events and
  publishes the progress. ``before_update()`` makes the current stream wait for the side stream,
  so the optimizer's kernels run after the copies without blocking the host.

Never torn, by construction: every source tensor's version counter (bumped by each in-place
operation on it or on any view of it, once the operation was issued) is recorded at ``save()`` and
compared at the *fence*: ``before_update()``, the next ``save()`` or ``close()``, all on the
training thread, so every operation it issued before has bumped its counter by then. Only a
snapshot whose sources are unchanged at the fence is sealed (the seal makes the daemon publish
the file); one whose source changed is abandoned: the daemon fails the save on every rank, and
the checkpoint never holds a mix of old and new values. So a lazy save commits only once the
training thread fenced it, and a save nobody fences is abandoned after ``snapshot_timeout_s``.
(Writes that bypass version counters, through ``tensor.data`` or raw pointers, are not seen:
fence before them.)
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StagingError
from ..format.items import PlannedItem
from .fork import ABANDONED, NO_ROOM, PROGRESS_NBYTES, SEAL_NBYTES, SEAL_ROOM_NBYTES, Snapshot, seal_offset
from .pool import Placement, StagingPool, plain_cpu_bytes, slot_view, tensor_bytes
from .segment import ShmSegment

log = logging.getLogger(__name__)


@dataclass
class _Copy:
    offset: int
    nbytes: int
    src: torch.Tensor | None  # None: bytes already in the slot
    version: int
    what: str
    event: Any = None  # CUDA: recorded after the copy was enqueued


@dataclass
class _Job:
    segment: ShmSegment
    copies: list[_Copy]
    seal: bytes
    seal_at: int
    nbytes: int
    step: int
    copied: threading.Event = field(default_factory=threading.Event)  # every copy landed (or failed)
    fenced: threading.Event = field(default_factory=threading.Event)  # the training thread decided
    torn: str = ""  # why the snapshot is abandoned ("" : seal it)
    no_room: bool = False  # abandoned because /dev/shm is full


class LazyCopier:
    """The copier thread of one Checkpointer, and the fences of :meth:`before_update`."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._jobs: "queue.Queue[_Job | None]" = queue.Queue()
        self._pending: list[_Job] = []
        self._streams: dict[Any, Any] = {}
        self._thread: threading.Thread | None = None

    def start(self, pool: StagingPool, slot: int, items: list[PlannedItem], placements: list[Placement],
              nbytes: int, step: int) -> Snapshot:
        """Queue the copies of one save into ``slot``; returns the snapshot the SAVE announces
        (its pid is this process: the daemon fails the save if it dies before sealing)."""
        import os

        seg = pool.segments[slot]
        base = seg.base
        if base is None:
            raise StagingError(f"rank {self.rank}: staging slot {slot} is not mapped")
        at = seal_offset(nbytes)
        seg.check_room(at + SEAL_ROOM_NBYTES)
        seg.write(at, bytes(SEAL_NBYTES + PROGRESS_NBYTES))
        job = _Job(seg, [], secrets.token_bytes(SEAL_NBYTES), at, nbytes, step)
        for item, p in zip(items, placements):
            src = item.payload
            if not isinstance(src, torch.Tensor):
                seg.write(p.offset, src)
                job.copies.append(_Copy(p.offset, p.nbytes, None, 0, item.record.where()))
                continue
            copy = _Copy(p.offset, p.nbytes, src, _version(src), item.record.where())
            if src.device.type == "cuda":
                seg.reserve()
                copy.event = self._enqueue_cuda(base, p, src)
            job.copies.append(copy)
        self._pending.append(job)
        self._ensure_thread()
        self._jobs.put(job)
        return Snapshot(os.getpid(), job.seal, at)

    def _enqueue_cuda(self, base: torch.Tensor, p: Placement, src: torch.Tensor) -> Any:
        stream = self._streams.get(src.device)
        if stream is None:
            stream = self._streams[src.device] = torch.cuda.Stream(device=src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            slot_view(base, p, src.dtype, src.shape).copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def fence(self) -> None:
        """Decide every pending snapshot, on the training thread: seal it, or abandon it if one of
        its sources changed since ``save()`` (see the module docstring).

        CPU copies still running are waited for (bounded by ``snapshot_timeout_s``); CUDA copies
        are ordered before the work queued next on the current streams, without blocking.
        """
        for job in self._pending:
            if any(c.event is not None for c in job.copies):
                for device, stream in self._streams.items():
                    torch.cuda.current_stream(device).wait_stream(stream)
            if any(c.src is not None and c.event is None for c in job.copies):
                self._wait(job.copied, job)
            changed = next((c.what for c in job.copies
                            if c.src is not None and _version(c.src) != c.version), "")
            if changed and not job.torn:
                job.torn = f"{changed} was modified before the snapshot was fenced"
            job.fenced.set()
        self._pending.clear()

    def _wait(self, event: threading.Event, job: _Job) -> None:
        if not event.wait(self.timeout_s):
            raise StagingError(f"rank {self.rank}: the lazy snapshot of step {job.step} did not finish "
                               f"copying within {self.timeout_s:g} s (CKPTD_SNAPSHOT_TIMEOUT_S)")

    def wait_all(self) -> None:
        """Fence every pending snapshot and wait until the copier is done with it (closing, or a
        pool about to be unmapped)."""
        jobs = list(self._pending)
        self.fence()
        for job in jobs:
            self._wait(job.copied, job)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.timeout_s)
            self._thread = None

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"ckptd-lazy-r{self.rank}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._copy(job)
            except Exception as exc:  # noqa: BLE001 - the save fails on its handle via the daemon
                job.torn = job.torn or f"the copy failed: {type(exc).__name__}: {exc}"
                job.no_room = isinstance(exc, StagingError)
            finally:
                job.copied.set()
            self._decide(job)

    def _copy(self, job: _Job) -> None:
        """Copy item by item, publishing the progress after each (the daemon writes as it goes)."""
        seg = job.segment
        for c in job.copies:
            if c.src is not None:
                if c.event is not None:
                    c.event.synchronize()
                elif plain_cpu_bytes(c.src):
                    if c.nbytes:
                        seg.write(c.offset, tensor_bytes(c.src))
                else:
                    seg.reserve()
                    slot_view(seg.base, Placement(c.offset, c.nbytes), c.src.dtype, c.src.shape).copy_(c.src)
            _publish(seg, job.seal_at, c.offset + c.nbytes)

    def _decide(self, job: _Job) -> None:
        """Seal once the training thread fenced the snapshot unchanged; otherwise abandon it."""
        if not job.fenced.wait(self.timeout_s):
            job.torn = job.torn or f"it was not fenced within {self.timeout_s:g} s (no before_update())"
        if job.torn:
            log.warning("rank %d: the lazy snapshot of step %d is abandoned: %s; call "
                        "Checkpointer.before_update() (or attach(optimizer)) before changing saved "
                        "tensors", self.rank, job.step, job.torn)
            _publish(job.segment, job.seal_at, NO_ROOM if job.no_room else ABANDONED)
            return
        _publish(job.segment, job.seal_at, job.nbytes)
        job.segment.write(job.seal_at, job.seal)


def _version(t: torch.Tensor) -> int:
    """The tensor's version counter (-1 where torch keeps none: inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _publish(seg: ShmSegment, seal_at: int, value: int) -> None:
    seg.write(seal_at + SEAL_NBYTES, value.to_bytes(PROGRESS_NBYTES, "little"))
