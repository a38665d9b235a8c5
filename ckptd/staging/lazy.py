"""Lazy snapshots: ``save()`` returns after planning; the copies into the ring run behind training.

Parameters and optimizer state do not change between one optimizer step and the next: forward and
backward only read them. A lazy save (``snapshot="lazy"``) therefore copies them into the rank's
staging ring while forward and backward run, and only the next optimizer step has to wait, for
what is not copied yet: :meth:`ckptd.Checkpointer.before_update` (or
``Checkpointer.attach(optimizer)``, which calls it from the optimizer's step pre-hook).

A copier thread produces the items in order, each once the daemon made room for it in the ring
(:mod:`ckptd.staging.ring`), publishing its progress after each item and a seal at the end: the
protocol of fork snapshots (:mod:`ckptd.staging.fork`), so the daemon writes each item as soon
as it is copied and fails the save if the seal never comes.

- CPU tensors: ``pwrite`` from the tensor's memory (GIL released). ``before_update()`` waits for
  the copies.
- CUDA tensors: device-to-host copies on a side stream that waits for the work queued before
  ``save()``; ``before_update()`` waits only until every copy is *queued*, then makes the current
  stream wait for the side stream, so the optimizer's kernels run after the copies without the
  host waiting for them.

Never torn, by construction: every source tensor's version counter (bumped by each in-place
operation on it or on any view of it, once the operation was issued) is recorded at ``save()`` and
compared at the *fence*: ``before_update()``, the next ``save()``, ``handle.wait()`` or
``close()``, all on the training thread, so every operation it issued before has bumped its
counter by then. Only a snapshot whose sources are unchanged at the fence is sealed (the seal
makes the daemon publish the file); one whose source changed is abandoned: the daemon fails the
save on every rank, and the checkpoint never holds a mix of old and new values. So a lazy save
commits only once the training thread fenced it, and a save nobody fences is abandoned after
``snapshot_timeout_s``. Writes that bump no version counter are not seen, and may tear a save:
through ``tensor.data`` (or into a saved ``param.data``), fused optimizer steps, collectives,
numpy, DLPack, raw pointers, storage aliases, rebinding ``.data``; the README lists them and what
to do (fence before them), and tests/integration/test_lazy_snapshot.py checks that list. A
checksum of the copy compared at the fence would see them, but reads the whole state on the
training thread at every fence (0.57-0.70 s for 2 GiB, against a stall of some 30 ms).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import StagingError
from ..format.items import PlannedItem
from .devcopy import DeviceCopier
from .owned import copy_unowned
from .producer import Claim, Snapshot, process_alive, start_block
from .rankside import Placement, StagingRing
from .ring import block_offset, give_up_mark, span

log = logging.getLogger(__name__)

# How long past close()'s deadline it waits for the copier thread to stop (it gives up waiting for
# ring space within a poll, 5 ms; a copy under way finishes its pwrite of at most 64 MiB).
STOP_MARGIN_S = 0.5


@dataclass
class _Job:
    ring: StagingRing
    start: int
    block: int
    items: list[PlannedItem]
    placements: list[Placement]
    versions: list[tuple[int, int]]  # of each item at save() (see _versions)
    seal: bytes
    step: int
    daemon_pid: int | None = None  # the node daemon that frees ring space for it (None: not known)
    daemon_alive: Callable[[], bool] | None = None  # whether that daemon still runs (process_alive)
    ready: dict[Any, Any] | None = None  # CUDA: per device, an event on its current stream at save()
    enqueued: threading.Event = field(default_factory=threading.Event)  # every copy issued
    copied: threading.Event = field(default_factory=threading.Event)  # every copy landed (or failed)
    fenced: threading.Event = field(default_factory=threading.Event)  # the training thread decided
    decided: threading.Event = field(default_factory=threading.Event)  # sealed or given up: done with the ring
    torn: str = ""  # why the snapshot is abandoned ("" : seal it)
    failure: BaseException | None = None  # the copy's error, if it failed

    @property
    def cuda(self) -> bool:
        return self.ready is not None


class LazyCopier:
    """The copier thread of one Checkpointer, and the fences of :meth:`fence`."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[_Job] = []
        self._held: list[_Job] = []  # started, handed to the copier thread by go()
        self._handed: list[_Job] = []  # handed to the copier thread, maybe not decided yet
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()  # closing: a copy waiting for ring space gives up
        self._daemon_gone = threading.Event()  # no daemon frees ring space: such a wait gives up too

    def start(
        self, ring: StagingRing, claim: Claim, owned: set[int] | None = None, daemon_pid: int | None = None
    ) -> LazyProducer:
        """Prepare the production of one save; its producer, whose snapshot the SAVE announces (its
        pid is this process: the daemon fails the save if it dies before sealing). The copier
        thread starts on it at :meth:`go` (after the SAVE's round trip: a copier running meanwhile
        would compete with ``save()`` for the interpreter, and the stall is what matters here).
        ``owned``: with an optimizer attached, the storages it owns; the other small tensors are
        copied now (:mod:`ckptd.staging.owned`). ``daemon_pid``: the node daemon that frees ring
        space; the copy gives up as soon as it is gone."""
        seal = start_block(ring, claim.block)
        items = [_copied_if_unversioned(i) for i in claim.items]
        if owned is not None:
            items = copy_unowned(items, owned)
        job = _Job(
            ring,
            claim.start,
            claim.block,
            items,
            claim.placements,
            [_versions(i) for i in items],
            seal,
            claim.step,
            daemon_pid,
            process_alive(daemon_pid) if daemon_pid else None,
        )
        devices = {i.payload.device for i in items if isinstance(i.payload, torch.Tensor) and i.payload.is_cuda}
        if devices:
            job.ready = {}
            for device in devices:  # the copies read what was queued before save(), on each device
                event = job.ready[device] = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
        self._pending.append(job)
        self._held.append(job)
        return LazyProducer(self, job, Snapshot(pid=os.getpid(), seal=seal, seal_offset=block_offset(claim.block)))

    def go(self) -> None:
        """Hand the saves :meth:`start` prepared to the copier thread."""
        if self._held:
            self._ensure_thread()
            self._handed = [j for j in self._handed if not j.decided.is_set()]
            for job in self._held:
                self._handed.append(job)
                self._jobs.put(job)
            self._held.clear()

    def fence(self, deadline: float | None = None, *, keep_late: bool = False, until_step: int | None = None) -> bool:
        """Decide every pending snapshot (with ``until_step``: those up to that step's, in save
        order), on the training thread: seal it, or abandon it if one of its sources changed since
        ``save()`` (see the module docstring).

        CPU copies still running are waited for; CUDA copies only until they are queued, then the
        current streams wait for them. The wait is bounded by ``snapshot_timeout_s`` (raises
        StagingError after it) or, when given, by ``deadline`` (monotonic): a snapshot not copied
        by then is abandoned (closing), or with ``keep_late`` it and the later ones stay pending
        (a wait with a timeout; StagingError still after ``snapshot_timeout_s``) and this returns
        False.
        """
        self.go()
        jobs = list(self._pending)
        if until_step is not None:
            last = next((i for i, j in enumerate(jobs) if j.step == until_step), -1)
            jobs = jobs[: last + 1]  # none when that step's snapshot was decided already
        for job in jobs:
            if not self._wait(job.enqueued if job.cuda else job.copied, job, deadline, keep_late=keep_late):
                if keep_late:
                    return False
                job.torn = job.torn or "the Checkpointer closed before it was copied"
            elif job.cuda:
                job.ring.order_after_copies()
            changed = next((i.record.where() for i, v in zip(job.items, job.versions) if _versions(i) != v), "")
            if changed and not job.torn:
                job.torn = f"{changed} was modified before the snapshot was fenced; {_FENCE_ADVICE}"
            job.fenced.set()
            self._pending.remove(job)
        return True

    def _wait(
        self, event: threading.Event, job: _Job, deadline: float | None = None, *, keep_late: bool = False
    ) -> bool:
        """Wait for ``event`` up to ``snapshot_timeout_s`` (raises StagingError after it) or until
        ``deadline`` (returns False at it; with ``keep_late`` only when it comes first)."""
        if deadline is not None:
            remaining_s = deadline - time.monotonic()
            if not keep_late or remaining_s < self.timeout_s:
                return event.wait(max(0.0, min(self.timeout_s, remaining_s)))
        if not event.wait(self.timeout_s):
            raise StagingError(
                f"rank {self.rank}: the lazy snapshot of step {job.step} did not finish "
                f"copying within {self.timeout_s:g} s (CKPTD_SNAPSHOT_TIMEOUT_S)"
            )
        return True

    def drop(self, job: _Job) -> None:
        """Forget a save the daemon never took (its range is given back next): not handed to the
        copier thread yet, it is dropped unread (running it would wait for ring room the daemon
        never frees); one handed over already is waited for."""
        if job not in self._held:
            self.wait_all()
            return
        self._held.remove(job)
        if job in self._pending:
            self._pending.remove(job)
        job.torn = "the daemon did not take the save"
        job.fenced.set()

    def wait_all(self, *, daemon_gone: bool = False) -> None:
        """Fence every pending snapshot and wait until the copier is done with every save handed
        to it, its seal or give-up mark written (a ring about to be unmapped: a CUDA save fenced
        earlier may still be landing). ``daemon_gone``: no daemon frees ring space any more, so a
        copy waiting for it gives up at once (its save failed anyway) instead of after
        ``snapshot_timeout_s``."""
        if daemon_gone:
            self._daemon_gone.set()
        try:
            self.fence()
            for job in self._handed:
                self._wait(job.decided, job)
            self._handed = []
        finally:
            self._daemon_gone.clear()  # the next ring has a daemon again

    def stop(self, deadline: float) -> bool:
        """Closing: fence the pending snapshots (those not copied by ``deadline`` are abandoned),
        make a copy still waiting for ring space give up, and wait for the copier thread until
        ``deadline`` plus :data:`STOP_MARGIN_S`. False if it still runs: it may still write into
        the ring, which must then stay mapped."""
        self.fence(deadline)
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        self._jobs.put(None)
        thread.join(max(0.0, deadline - time.monotonic()) + STOP_MARGIN_S)
        if thread.is_alive():
            log.warning(
                "rank %d: the lazy copier thread did not stop in time; its staging ring stays mapped", self.rank
            )
            return False
        return True

    @property
    def writing(self) -> bool:
        """Whether the copier thread may still write into a ring: a save handed to it is not
        decided yet."""
        return any(not j.decided.is_set() for j in self._handed)

    def _gives_up(self) -> bool:
        return self._stopping.is_set() or self._daemon_gone.is_set()

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
                job.torn = job.torn or _copy_failed(job, exc)
                job.failure = exc
            finally:
                job.enqueued.set()
                job.copied.set()
            try:
                self._decide(job)
            except Exception as exc:  # noqa: BLE001 - the daemon fails a save never sealed; the thread goes on
                log.warning("rank %d: deciding the lazy snapshot of step %d failed: %s", self.rank, job.step, exc)
            finally:
                job.items = []  # the save's tensors (a split tensor's copy among them) go now
                job.decided.set()
            job = None

    def _copy(self, job: _Job) -> None:
        """Produce item by item, each once the ring has room, publishing the progress after each
        (the daemon writes as it goes). CUDA copies are issued first (the fence waits only for
        that) and published once they landed, in order (ckptd.staging.devcopy)."""
        ring = job.ring
        # A wait for ring space gives up at once when the Checkpointer closes or the daemon is gone:
        # its process is watched too, as the training thread learns of its death only after a
        # fence, which waits for this copy. The copy itself stops before its next item only on the
        # events (closing: it would read the trainer's tensors after close()), a check per item
        # that costs no system call.
        alive = job.daemon_alive

        def gives_up() -> bool:
            return self._gives_up() or (alive is not None and not alive())

        copier = DeviceCopier(ring, job.block, self.timeout_s, job.ready, gives_up, self._gives_up)
        try:
            copier.produce(job.start, job.items, job.placements)
            copier.flush()
            job.enqueued.set()
            copier.land()
        except BaseException:
            copier.abort()
            raise
        ring.writer.publish(job.block, job.start + span(p.offset + p.nbytes for p in job.placements))

    def _decide(self, job: _Job) -> None:
        """Seal once the training thread fenced the snapshot unchanged; otherwise abandon it."""
        writer = job.ring.writer
        if not job.fenced.wait(self.timeout_s):
            job.torn = job.torn or (
                f"it was not fenced within {self.timeout_s:g} s (no before_update()); {_FENCE_ADVICE}"
            )
        if job.torn:
            log.warning("rank %d: the lazy snapshot of step %d is abandoned: %s", self.rank, job.step, job.torn)
            writer.publish(job.block, give_up_mark(job.failure))
            return
        writer.seal(job.block, job.seal)


class LazyProducer:
    """A :class:`~ckptd.staging.producer.Producer` that is the lazy copier thread: it copies behind
    training once the daemon took the save, and seals it at the fence."""

    def __init__(self, copier: LazyCopier, job: _Job, snapshot: Snapshot) -> None:
        self.copier = copier
        self.job = job
        self.snapshot = snapshot

    def after_ack(self) -> float:
        self.copier.go()
        return 0.0

    def cancel(self) -> None:
        self.copier.drop(self.job)  # the copier is done with the range before it is given back

    def detach(self) -> None:
        self.copier.go()


_FENCE_ADVICE = "call Checkpointer.before_update() (or attach(optimizer)) before changing saved tensors"


def _copy_failed(job: _Job, exc: Exception) -> str:
    """Why a save whose copy raised ``exc`` is abandoned: its node daemon died (nothing frees ring
    space any more, so the copy gave up), or the copy's own error."""
    if job.daemon_alive is not None and not job.daemon_alive():
        return (
            f"its node daemon (pid {job.daemon_pid}) died before it was copied, so nothing frees ring space; "
            "the save fails as not confirmed, and the next save() starts a new daemon"
        )
    return f"the copy failed: {type(exc).__name__}: {exc}"


def _copied_if_unversioned(item: PlannedItem) -> PlannedItem:
    """``item``, or for an inference tensor (torch keeps no version counter for it, so a write to
    it before the fence would go unseen) a copy of it taken now, in ``save()``."""
    t = item.payload
    if isinstance(t, torch.Tensor) and _version(t) < 0:
        with torch.inference_mode():
            return replace(item, payload=t.clone(), watch=None)
    return item


def _versions(item: PlannedItem) -> tuple[int, int]:
    """The version counters that count writes to ``item``'s tensor: its own, and its ``watch``'s
    (a DTensor piece: writes through the DTensor bump only the DTensor's)."""
    if not isinstance(item.payload, torch.Tensor):
        return (0, 0)
    return (_version(item.payload), _version(item.watch) if item.watch is not None else 0)


def _version(t: torch.Tensor) -> int:
    """The tensor's version counter (-1 where torch keeps none: inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return -1
