"""What produces one save's items into its rank's staging ring: one type, three kinds.

A save's bytes reach the ring (:mod:`ckptd.staging.ring`) through exactly one producer:

- a forked copy-on-write child (:class:`ckptd.staging.children.ForkProducer`, ``snapshot="auto"``
  with plain CPU shards);
- the lazy copier thread (:class:`ckptd.staging.lazy.LazyProducer`, ``snapshot="lazy"``, or
  ``"auto"`` while an optimizer is attached);
- ``save()`` itself, issuing its copies before the SAVE and waiting for them after it
  (:class:`ckptd.staging.devcopy.InlineProducer`: CUDA shards, ``snapshot="copy"``, or when no
  child could be forked);
- a thread writing a device snapshot taken in ``save()`` while the ring is still being pinned
  (:class:`ckptd.staging.devsnap.DeviceSnapshotProducer`).

Order of one save (``ckptd.client.checkpointer``): claim a control block and the save's range of
the ring (:meth:`StagingRing.claim <ckptd.staging.rankside.StagingRing.claim>`, described by a
:class:`Claim`); start its producer (it clears the block and draws the seal: :func:`start_block`;
a fork child starts copying here); send the SAVE announcing :attr:`Producer.snapshot`; then
exactly one of

- :meth:`Producer.after_ack`: the daemon took the save (its SAVE_ACK came);
- :meth:`Producer.cancel`: the daemon never took it (refused, or never sent); returns once nothing
  writes into its range any more, and the caller gives the range back;
- :meth:`Producer.detach`: nobody knows (no answer, or the daemon was lost): the daemon may still
  write the save, so the producer runs to its end on its own and the range stays taken until the
  daemon frees it.

Every producer publishes its progress in the block after each item and seals the block when done,
or marks it as given up (:func:`ckptd.staging.ring.give_up_mark`); the daemon writes each item once
it is produced and fails a save that is never sealed (ckptd.daemon.snapshot).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..format.items import PlannedItem
from ..procid import same_process, start_ticks_of
from .rankside import Placement, StagingRing
from .ring import PROGRESS_NBYTES, SEAL_NBYTES, block_offset, span


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Who produces a save's items (a forked child, or the rank's own process), and the seal it
    writes in the save's control block at ``seal_offset`` when done."""

    pid: int
    seal: bytes
    seal_offset: int


@dataclass(frozen=True, kw_only=True)
class Claim:
    """What one save claimed of its rank's ring: control ``block``, its virtual ``start``, and
    its ``items`` laid out at ``placements`` relative to it."""

    step: int
    block: int
    start: int
    items: list[PlannedItem]
    placements: list[Placement]

    @property
    def end(self) -> int:
        """Virtual end of the save's range (aligned)."""
        return self.start + span(p.offset + p.nbytes for p in self.placements)


class Producer(Protocol):
    """Produces one save's items into the ring (see the module docstring for the order of calls)."""

    @property
    def snapshot(self) -> Snapshot:
        """What the SAVE announces: the producing process and the seal it will write."""
        ...

    def after_ack(self) -> float:
        """The daemon took the save: produce it (or let it be produced); the seconds ``save()``
        waited meanwhile for ring space or pinning. Raises what producing inside ``save()`` raised."""
        ...

    def cancel(self) -> None:
        """The daemon never took the save: return once nothing writes into its range any more."""
        ...

    def detach(self) -> None:
        """No answer: the daemon may still write the save; let the producer finish on its own."""
        ...


def process_alive(pid: int) -> Callable[[], bool]:
    """Whether process ``pid``, as it is now, still runs (the node daemon: a wait for ring space
    only it frees ends when it is gone, instead of at ``snapshot_timeout_s``). By its start time
    too (ckptd.procid): a zombie nobody reaped yet is gone (a daemon's parent is whatever reaps
    orphans, which may take its time or never do it), and so is a later process given its pid."""
    start_ticks = start_ticks_of(pid)

    def alive() -> bool:
        return same_process(pid, start_ticks)

    return alive


def start_block(ring: StagingRing, block: int) -> bytes:
    """Clear a control block for a new save (no stale seal or progress); the save's seal."""
    ring.segment.write(block_offset(block), bytes(SEAL_NBYTES + PROGRESS_NBYTES))
    return secrets.token_bytes(SEAL_NBYTES)
