"""The daemon's view of its ranks' staging rings (ckptd.staging.ring): mapped rings, the saves
in flight in each (by control block), and the writes queued for each.

A rank's saves stream through its ring in order, so the daemon writes them in order too: one
write per ring at a time, the next queued until it finished (it frees the ring space the next
save's producer may be waiting for).

A ring registered by a rank belongs to the daemon: it is unmapped and unlinked here once it is
*retired* (its rank closed, died, or registered a newer ring) and no write still reads from it.
A ring is bound to the connection that registered it: only that connection saves from it, and
only its own later rings or its own BYE retire it.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import StagingError
from ..format.records import ItemRecord
from ..staging.ring import BLOCKS, HEADER_NBYTES, PAGE, Placement, RingMap
from ..staging.segment import ShmSegment, segment_name
from .snapshot import boottime_s

log = logging.getLogger(__name__)


@dataclass
class DaemonRing:
    rank: int
    generation: str
    capacity: int  # the ring's data bytes
    map: RingMap  # the daemon's double mapping of the ring's data region
    segment: ShmSegment  # for unlinking
    owner: bytes  # the registering client's socket identity
    registered_s: float = field(default_factory=boottime_s)  # on the clock of process start times
    busy: set[int] = field(default_factory=set)  # control blocks of saves in flight
    retired: bool = False
    writing: bool = False  # a write of this ring is running
    queued: deque[Callable[[], None]] = field(default_factory=deque)  # writes waiting for it
    # The item layout of the rank's last SAVE that named one: ``(layout id, records, placements,
    # held keys)``. A rank whose state keeps its structure from save to save sends only the id (see
    # ckptd.client.layout), so neither side re-encodes, re-decodes or re-checks 10,000 records.
    layout: tuple[str, list[ItemRecord], list[Placement], list[str]] | None = None

    def check_block(self, block: int) -> None:
        """Raise StagingError unless control block ``block`` exists and is free."""
        if not 0 <= block < BLOCKS:
            raise StagingError(f"rank {self.rank}: control block {block} does not exist")
        if block in self.busy:
            raise StagingError(f"rank {self.rank}: control block {block} is in use by a save in flight")

    def take_block(self, block: int) -> None:
        """Mark control block ``block`` as used by a save in flight (until :meth:`write_done`)."""
        self.check_block(block)
        self.busy.add(block)

    def queue_write(self, start: Callable[[], None]) -> None:
        """Run ``start()`` (which hands a write of this ring to a writer thread) once the ring's
        earlier writes finished: a rank's saves stream through its ring in order."""
        self.queued.append(start)
        self._next_write()

    def write_done(self, block: int) -> None:
        """The write of the save in ``block`` finished (or failed): free the block, start the next."""
        self.busy.discard(block)
        self.writing = False
        self._next_write()

    def _next_write(self) -> None:
        if not self.writing and self.queued:
            self.writing = True
            self.queued.popleft()()


class RingTable:
    def __init__(self, shm_prefix: str) -> None:
        self.shm_prefix = shm_prefix
        self.rings: dict[tuple[int, str], DaemonRing] = {}

    def register(self, rank: int, generation: str, capacity: int, names: list[str], owner: bytes) -> DaemonRing:
        """Map a rank's new ring; older rings this connection registered retire."""
        if len(names) != 1 or names[0] != segment_name(self.shm_prefix, rank, generation, 0):
            raise StagingError(
                f"rank {rank}: segment names {names[:2]}... are not its staging ring "
                f"{segment_name(self.shm_prefix, rank, generation, 0)}; they belong to "
                "another job or node"
            )
        if (rank, generation) in self.rings:
            raise StagingError(f"rank {rank}: ring {generation} is registered already")
        if not 0 < capacity <= (1 << 48) or capacity % PAGE:
            raise StagingError(f"rank {rank}: a ring of {capacity} bytes is not a positive number of pages")
        segment, rmap = attach_ring(names[0], capacity)
        for ring in self.rings.values():
            if ring.owner == owner:
                ring.retired = True
        ring = DaemonRing(rank=rank, generation=generation, capacity=capacity, map=rmap, segment=segment, owner=owner)
        self.rings[(rank, generation)] = ring
        self.collect()
        return ring

    def get(self, rank: int, generation: str, owner: bytes) -> DaemonRing:
        """The live ring ``generation`` of ``rank``, if the connection ``owner`` registered it."""
        ring = self.rings.get((rank, generation))
        if ring is None or ring.retired:
            raise StagingError(
                f"rank {rank}: no live staging ring {generation} here (the daemon may "
                "have restarted); the Checkpointer registers a new ring"
            )
        if ring.owner != owner:
            raise StagingError(
                f"rank {rank}: staging ring {generation} was registered by another "
                "connection; a rank saves from its own rings only"
            )
        return ring

    def write_done(self, rank: int, generation: str, block: int) -> None:
        """A write from ``block`` of that ring finished; a retired ring is released once idle."""
        ring = self.rings.get((rank, generation))
        if ring is not None:
            ring.write_done(block)
            self.collect()

    def retire_owner(self, owner: bytes) -> None:
        for ring in self.rings.values():
            if ring.owner == owner:
                ring.retired = True
        self.collect()

    def collect(self) -> None:
        """Unlink retired rings that no write uses any more."""
        for key, ring in list(self.rings.items()):
            if ring.retired and not ring.busy:
                self._release(ring)
                del self.rings[key]

    def _release(self, ring: DaemonRing) -> None:
        ring.map.close()
        ring.segment.close()
        ring.segment.unlink()
        log.info("released staging ring %s of rank %d (%d bytes)", ring.generation, ring.rank, ring.capacity)

    def release_all(self, *, unmap: bool = True) -> None:
        """Release every ring; without ``unmap`` (a writer thread may still read one) only their
        names are unlinked, and the mappings go with the process."""
        for ring in self.rings.values():
            if unmap:
                self._release(ring)
            else:
                ring.segment.unlink()
        self.rings.clear()

    def segment_paths(self) -> list[str]:
        """The /dev/shm files of the rings mapped here (for memory accounting)."""
        return [str(p.segment.path) for p in self.rings.values()]

    def summary(self) -> list[dict]:
        return [
            {
                "rank": p.rank,
                "generation": p.generation,
                "ring_nbytes": p.capacity,
                "consumed": p.map.consumed(),
                "busy": sorted(p.busy),
                "queued": len(p.queued),
                "retired": p.retired,
            }
            for p in self.rings.values()
        ]


def attach_ring(name: str, capacity: int) -> tuple[ShmSegment, RingMap]:
    """Open a rank's ring segment (checked: a private regular file of this user, of the announced
    size) and map it as a ring."""
    segment = ShmSegment.attach(name, HEADER_NBYTES + capacity)
    try:
        fd = os.open(segment.path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            # The very file checked and mapped above, still of its size: another one (replaced
            # meanwhile, or shorter) would fault (SIGBUS) in a writer thread, and end the daemon.
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != segment.identity or st.st_size != HEADER_NBYTES + capacity:
                raise StagingError(
                    f"{segment.path} was replaced or resized while it was being mapped: the rank's staging ring "
                    "is not the file it registered; its next save registers a new ring"
                )
            return segment, RingMap(fd, capacity)
        finally:
            os.close(fd)
    except BaseException:
        segment.close()
        raise
