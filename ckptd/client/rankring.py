"""A Checkpointer's staging ring and what produces its saves into it.

:class:`RankRing` owns the rank's :class:`~ckptd.staging.rankside.StagingRing` (created once the size
of a save is known, and registered with the daemon), and the producers of
:mod:`ckptd.staging.producer`: the lazy copier (``snapshot="lazy"``, or ``"auto"`` while an
optimizer is attached), the fork snapshot children (``"auto"``), else ``save()`` itself.

Order of use, on the training thread: :meth:`~RankRing.ensure` the ring; per save
:meth:`~RankRing.wait_block`, claim its range (``StagingRing.claim``), :meth:`~RankRing.start`
its producer and tell it what became of the SAVE; :meth:`~RankRing.fence` before the tensors
change (lazy saves); :meth:`~RankRing.drop` the ring when the daemon no longer owns it or the
rank disconnects; :meth:`~RankRing.stop_copier` and ``children.close`` when closing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..config import CkptdConfig, parse_budget
from ..control.protocol import RegisterRing, RingOk
from ..errors import DaemonError, StagingError
from ..format.items import PlannedItem, largest_object, split_large_items
from ..staging.children import SnapshotChildren
from ..staging.devcopy import InlineProducer
from ..staging.devsnap import (
    HOST_COPY_MAX_NBYTES,
    DeviceSnapshotProducer,
    device_snapshot_fits,
    free_device_nbytes,
    tensor_nbytes_by_device,
)
from ..staging.lazy import STOP_MARGIN_S, LazyCopier
from ..staging.owned import OwnedStorages
from ..staging.pinning import cuda_registrar
from ..staging.producer import Claim, Producer
from ..staging.rankside import Placement, StagingRing, place
from ..staging.ring import BLOCKS, capacity_for
from .link import DaemonLink

log = logging.getLogger(__name__)


class RankRing:
    """One Checkpointer's staging ring (``current``, None until created or after a drop) and its
    producers (``lazy``: the copier, None until lazy saves are used; ``children``: fork snapshots)."""

    def __init__(
        self, rank: int, local_world_size: int, shm_prefix: str, config: CkptdConfig, link: DaemonLink
    ) -> None:
        self.rank = rank
        self.link = link  # registers the ring with the daemon
        self.local_world_size = local_world_size
        self.shm_prefix = shm_prefix
        self.config = config
        self.current: StagingRing | None = None
        self.children = SnapshotChildren(rank)  # fork snapshot children not reaped yet
        self.lazy = LazyCopier(rank, config.snapshot_timeout_s) if config.snapshot == "lazy" else None
        self.attached = 0  # optimizers attach() hooked (snapshot="auto": lazy while > 0)
        self.optimizers: list[Any] = []  # those optimizers (what they own stays lazy: ckptd.staging.owned)
        self.owned = OwnedStorages()
        self.device_snapshots: list[DeviceSnapshotProducer] = []  # their threads may still write
        self.device_snapshots_taken = 0  # saves made device snapshots so far

    def ensure(
        self, nbytes: int, *, pin: bool = True, device: Any = None, holds: PlannedItem | None = None
    ) -> StagingRing:
        """The ring, created (and registered with the daemon, which owns it from then on) once the
        size of a save is known (``prepare()``, ``load()``, a byte budget, else the first save),
        sized by the staging budget from that save's ``nbytes``; later saves of any size stream
        through it. ``holds``: an object (which cannot be split) the ring must hold whole; a ring
        too small for it is replaced by a larger one (:meth:`_capacity`, :meth:`_retire`). In a
        process that uses CUDA, a background thread pins it (ckptd.staging.pinning): from here
        with ``pin`` (for DMA from ``device``), else from :meth:`start`, after the save's device
        snapshot was taken (pinning holds the CUDA driver: a ``cudaHostRegister`` under way
        delays the snapshot's allocation until it returns)."""
        ring = self.current
        if ring is not None and holds is not None and len(holds.payload) > ring.capacity:
            capacity = self._capacity(nbytes, holds, grow=True)  # raises before the ring is retired
            self._retire(ring, holds, capacity)
            ring = self._register(capacity)
        elif ring is None:
            ring = self._register(self._capacity(nbytes, holds))
        if pin:
            self.pin(ring, device)
        return ring

    def _register(self, capacity: int) -> StagingRing:
        """Create a ring of ``capacity`` data bytes and register it with the daemon, which owns it
        from then on (and retires this rank's earlier ring)."""
        ring = StagingRing.create(self.shm_prefix, self.rank, capacity, self.config.snapshot_timeout_s)
        try:
            self.link.request(
                RegisterRing(rank=self.rank, generation=ring.generation, ring_nbytes=ring.capacity, names=ring.names),
                RingOk,
            )
        except BaseException:
            ring.close(unlink=True)  # the daemon never took it over
            raise
        self.current = ring
        return ring

    def ring_for(
        self, items: list[PlannedItem], placements: list[Placement], nbytes: int
    ) -> tuple[StagingRing, list[PlannedItem], list[Placement], int]:
        """The ring a save of ``items`` (laid out at ``placements``, ``nbytes`` in all) streams
        through (not pinned here: :meth:`start`), and the items, placements and bytes it is
        stored as there: a tensor larger than the ring as several chunks (split_large_items);
        an object larger than the ring makes a larger ring (:meth:`ensure`)."""
        ring = self.current
        if ring is None or any(p.nbytes > ring.capacity for p in placements):
            ring = self.ensure(nbytes, pin=False, holds=largest_object(items))
            if any(p.nbytes > ring.capacity for p in placements):
                items = split_large_items(items, ring.capacity)  # streams through a ring smaller than it
                placements, nbytes = place(items)
        return ring, items, placements, nbytes

    def _capacity(self, nbytes: int, holds: PlannedItem | None, *, grow: bool = False) -> int:
        """Data bytes of a new ring for saves of ``nbytes``: the staging budget's, or where an
        object to hold (``holds``) is larger, or the ring it replaces was too small for it
        (``grow``), at least twice that object (a value that keeps growing, say a history, then
        makes a new ring now and then, not at every save). A byte budget is a bound on the node's
        shared memory: an object larger than a rank's part of it raises StagingError instead."""
        fraction, node_nbytes = parse_budget(self.config.staging_budget)
        capacity = capacity_for(fraction, node_nbytes, nbytes, self.local_world_size)
        need = 0 if holds is None else len(holds.payload)
        if need <= capacity and not grow:
            return capacity
        if not fraction:
            raise StagingError(
                f"rank {self.rank}: {holds.record.where() if holds else 'an object'} takes {need} bytes, more than "
                f"its staging ring's {capacity} (staging_budget={self.config.staging_budget} for the node's "
                f"{self.local_world_size} rank(s)), and an object (a plain value or ShardedObject) cannot be "
                f"split. Make the Checkpointer with CKPTD_STAGING_BUDGET of at least "
                f"{need * self.local_world_size} bytes, or a multiple of the save (e.g. 0.25x: the ring then "
                "grows to hold such an object), or save the object smaller (e.g. as a tensor)"
            )
        return max(capacity, capacity_for(2.0, 0, need, 1))

    def _retire(self, ring: StagingRing, holds: PlannedItem, capacity: int) -> None:
        """Replace ``ring``, too small for the object ``holds``: once nothing of this process
        writes into it any more (the lazy copier's and device snapshots' saves in it copied: this
        waits for the daemon to make their room), unmap it. The daemon retires it when the next
        ring is registered, writes the saves still in it and then unlinks it (as on a
        re-registration: DaemonSession.register_again); a fork child has its own mapping."""
        log.info(
            "rank %d: %s takes %d bytes, more than the staging ring's %d; a ring of %d bytes replaces it",
            self.rank,
            holds.record.where(),
            len(holds.payload),
            ring.capacity,
            capacity,
        )
        self.quiesce()
        self.drop(unlink=False)

    def pin(self, ring: StagingRing, device: Any = None) -> None:
        """Start pinning ``ring`` in the background for DMA from ``device`` (default: the current
        CUDA device), once, where ``pin_memory`` is on and this process uses CUDA."""
        if ring.pinner is None and self.config.pin_memory:
            registrar = cuda_registrar(device)  # None until this process uses CUDA
            if registrar is not None:
                ring.start_pinning(registrar)

    def wait_pinned(self) -> None:
        """Return once the current ring is pinned, its pinning failed or stopped (the saves then
        wait for or bypass the chunks left, as during pinning), or nothing pins it; raises
        StagingError after ``snapshot_timeout_s``. ``prepare()`` calls it: a first save made while
        chunks are still being registered takes a device snapshot whose allocation waits behind
        each registration."""
        ring = self.current
        if ring is None or ring.pinner is None:
            return
        t0 = time.monotonic()
        try:
            pinned = ring.pinner.wait(ring.capacity - 1, self.config.snapshot_timeout_s)  # chunks register in order
        except StagingError as exc:
            raise StagingError(
                f"prepare() on rank {self.rank}: {exc}; the pinning goes on in the background. Pass "
                "prepare(..., wait=False), raise CKPTD_SNAPSHOT_TIMEOUT_S, or set CKPTD_PIN_MEMORY=0 "
                "(CUDA tensors then go through pageable memory)"
            ) from exc
        if pinned:
            log.info("rank %d: the staging ring was pinned after a %.2f s wait", self.rank, time.monotonic() - t0)

    def wait_block(self, ring: StagingRing, step: int, idle: Callable[[float], None]) -> None:
        """Wait for a free control block (BLOCKS saves of this rank in flight at most); ``idle(s)``
        takes the daemon's notifications for up to ``s`` seconds meanwhile."""
        if ring.has_free_block():
            return
        t0 = time.monotonic()
        deadline = t0 + self.config.in_flight_wait_timeout_s
        while not ring.has_free_block():
            if time.monotonic() > deadline:
                raise DaemonError(
                    f"rank {self.rank}: {BLOCKS} saves still in flight after "
                    f"{self.config.in_flight_wait_timeout_s:.0f} s (CKPTD_IN_FLIGHT_WAIT_TIMEOUT_S) for step {step}"
                )
            idle(0.05)
        log.info("rank %d: waited %.3f s for a save of its to finish (step %d)", self.rank, time.monotonic() - t0, step)

    def attach(self, hook: Any, optimizer: Any) -> Attachment:
        """``optimizer`` is attached by ``hook`` (its step pre-hook that fences): with
        ``snapshot="auto"`` the saves are lazy from now on, until the last ``remove()``."""
        if self.config.snapshot == "auto" and self.lazy is None:
            self.lazy = LazyCopier(self.rank, self.config.snapshot_timeout_s)
        self.attached += 1
        self.optimizers.append(optimizer)
        return Attachment(self, hook, optimizer)

    def saves_lazily(self) -> bool:
        """Whether the next save is a lazy snapshot: ``snapshot="lazy"``, or ``"auto"`` with an
        optimizer attached."""
        return self.lazy is not None and (self.config.snapshot == "lazy" or self.attached > 0)

    def start(
        self, ring: StagingRing, claim: Claim, daemon_pid: int | None, idle: Callable[[float], None]
    ) -> tuple[Producer, float]:
        """Start what produces the claimed save: the lazy copier, a fork child (``snapshot="auto"``
        with a daemon to watch), else ``save()`` itself after the SAVE; and the seconds waited for
        a fork's turn (``idle`` as for :meth:`wait_block`). While the ring is still being pinned,
        a save with CUDA tensors is a device snapshot instead, where device memory allows
        (ckptd.staging.devsnap); a new ring's pinning starts once that snapshot is taken."""
        pinner, snap, device = ring.pinner, None, None
        self.device_snapshots = [p for p in self.device_snapshots if p.running]
        if pinner.running if pinner is not None else self.config.pin_memory and torch.cuda.is_initialized():
            nbytes = tensor_nbytes_by_device(claim.items)  # not at every save: ~1 us per tensor
            device = next((d for d in nbytes if d.type == "cuda"), None)
            snap = self._device_snapshot(ring, claim, nbytes)
        self.pin(ring, device)
        if snap is not None:
            return snap, 0.0
        lazy = self.lazy if self.saves_lazily() else None
        if lazy is not None:
            owned = self.owned.of(self.optimizers) if self.optimizers else None
            return lazy.start(ring, claim, owned, daemon_pid), 0.0
        waited_s = 0.0
        if self.config.snapshot == "auto" and daemon_pid:
            child, waited_s = self.children.fork(ring, claim, daemon_pid, idle)
            if child is not None:
                return child, waited_s
        return InlineProducer(ring, claim, self.config.snapshot_timeout_s, daemon_pid), waited_s

    def _device_snapshot(
        self, ring: StagingRing, claim: Claim, nbytes: dict[Any, int]
    ) -> DeviceSnapshotProducer | None:
        """A device snapshot of the claimed save, made while the ring is (about to be) pinned, if
        the save's CUDA tensors (``nbytes`` by device) fit in device memory; else None."""
        fraction = self.config.device_snapshot_fraction
        if fraction <= 0 or not any(d.type == "cuda" for d in nbytes):
            return None
        free = free_device_nbytes(nbytes)
        if not device_snapshot_fits(True, nbytes, free, fraction):
            log.info(
                "rank %d: step %d waits for the staging ring's pinning (tensors by device %s, free "
                "%s: more than device_snapshot_fraction=%g of the device memory free, or over %d "
                "host bytes)",
                self.rank,
                claim.step,
                {str(d): n for d, n in nbytes.items()},
                {str(d): n for d, n in free.items()},
                fraction,
                HOST_COPY_MAX_NBYTES,
            )
            return None
        try:
            producer = DeviceSnapshotProducer(ring, claim, self.config.snapshot_timeout_s)
        except torch.cuda.OutOfMemoryError as exc:  # the driver's free memory is not all ours to take
            log.info(
                "rank %d: step %d waits for the staging ring's pinning (device snapshot: %s)",
                self.rank,
                claim.step,
                exc,
            )
            return None
        self.device_snapshots.append(producer)
        self.device_snapshots_taken += 1
        return producer

    def fence(self, deadline: float | None = None, *, keep_late: bool = False, until_step: int | None = None) -> bool:
        """Decide the pending lazy saves (ckptd.staging.lazy.LazyCopier.fence); else nothing.
        False when ``keep_late`` left some undecided at ``deadline``."""
        return self.lazy is None or self.lazy.fence(deadline, keep_late=keep_late, until_step=until_step)

    def quiesce(self, *, daemon_gone: bool = False) -> None:
        """Return once the lazy copier and the device snapshots no longer write into the ring
        (about to be unmapped), each waited for up to ``snapshot_timeout_s``. ``daemon_gone``: no
        daemon drains the ring any more, so a device snapshot waiting for ring space gives up at
        once (its save has failed anyway) instead of waiting out that bound."""
        if self.lazy is not None:
            self.lazy.wait_all(daemon_gone=daemon_gone)
        for producer in self.device_snapshots:
            if daemon_gone:
                producer.stop()
            producer.join(self.config.snapshot_timeout_s)

    def drop(self, *, unlink: bool) -> None:
        """Unmap the ring (``unlink``: no daemon owns it); the next save makes a new one. A ring a
        producer may still write into (a device snapshot's thread or the lazy copier that did not
        stop in time) stays mapped and registered, only its name unlinked: unmapping it, or
        unregistering chunks under a DMA, would let that write land in whatever reuses them."""
        ring, self.current = self.current, None
        if ring is None:
            return
        if any(p.running for p in self.device_snapshots) or (self.lazy is not None and self.lazy.writing):
            log.warning("rank %d: a producer still writes into the staging ring; it stays mapped", self.rank)
            if unlink:
                ring.segment.unlink()
            return
        ring.close(unlink=unlink)

    def stop_copier(self, deadline: float) -> None:
        """Closing: stop the lazy copier and the device snapshots by ``deadline`` (plus
        STOP_MARGIN_S); one that still runs may write into the ring, which :meth:`drop` then
        leaves mapped."""
        self._stop_device_snapshots(deadline)
        if self.lazy is not None:
            self.lazy.stop(deadline)

    def _stop_device_snapshots(self, deadline: float) -> None:
        """Wait for the device snapshots' threads until ``deadline``, then make those waiting for
        ring space give up, and wait STOP_MARGIN_S more (one still running then keeps the ring
        mapped: :meth:`drop`)."""
        for producer in self.device_snapshots:
            producer.join(max(0.0, deadline - time.monotonic()))
        for producer in self.device_snapshots:
            producer.stop()
        if not all(p.join(STOP_MARGIN_S) for p in self.device_snapshots):
            log.warning("rank %d: a device snapshot's thread did not stop in time", self.rank)


class Attachment:
    """What :meth:`Checkpointer.attach <ckptd.client.checkpointer.Checkpointer.attach>` returns:
    ``remove()`` detaches the optimizer's hook."""

    def __init__(self, ring: RankRing, hook: Any, optimizer: Any) -> None:
        self._ring: RankRing | None = ring
        self._hook = hook
        self._optimizer = optimizer

    def remove(self) -> None:
        ring, self._ring = self._ring, None
        if ring is not None:
            self._hook.remove()
            ring.fence()  # a lazy save in flight is decided while the hook still counted
            ring.attached -= 1
            ring.optimizers.remove(self._optimizer)
