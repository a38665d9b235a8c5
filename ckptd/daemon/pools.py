"""The daemon's view of its ranks' staging pools: attached segments and which slots are busy.

A pool registered by a rank belongs to the daemon: it is unmapped and unlinked here once it is
*retired* (its rank closed, died, or registered a newer pool) and no write still reads from it.
A pool is bound to the connection that registered it: only that connection saves from it, and
only its own later pools or its own BYE retire it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..errors import StagingError
from ..format.records import ItemRecord
from ..staging.pool import Placement
from ..staging.segment import ShmSegment
from .snapshot import boottime_s

log = logging.getLogger(__name__)


@dataclass
class DaemonPool:
    rank: int
    generation: str
    slot_nbytes: int
    segments: list[ShmSegment]
    owner: bytes  # the registering client's socket identity
    registered_s: float = field(default_factory=boottime_s)  # on the clock of process start times
    busy: set[int] = field(default_factory=set)
    retired: bool = False
    # The item layout of the rank's last SAVE that named one: ``(layout id, records, placements)``.
    # A rank whose state keeps its structure from save to save sends only the id (see
    # ckptd.client.layout), so neither side re-encodes, re-decodes or re-checks 10,000 records.
    layout: tuple[str, list[ItemRecord], list[Placement]] | None = None


class PoolTable:
    def __init__(self, shm_prefix: str) -> None:
        self.shm_prefix = shm_prefix
        self.pools: dict[tuple[int, str], DaemonPool] = {}

    def register(self, rank: int, generation: str, slot_nbytes: int, names: list[str],
                 owner: bytes) -> DaemonPool:
        """Attach a rank's new segments; older pools this connection registered retire."""
        expected = f"{self.shm_prefix}r{rank}-{generation}-s"
        if not names or any(n != f"{expected}{i}" for i, n in enumerate(names)):
            raise StagingError(f"rank {rank}: segment names {names[:2]}... do not follow "
                               f"{expected}<i>; they belong to another job or node")
        if (rank, generation) in self.pools:
            raise StagingError(f"rank {rank}: pool {generation} is registered already")
        segments: list[ShmSegment] = []
        try:
            for n in names:
                segments.append(ShmSegment.attach(n, slot_nbytes))
        except StagingError:
            for s in segments:
                s.close()
            raise
        for pool in self.pools.values():
            if pool.owner == owner:
                pool.retired = True
        pool = DaemonPool(rank, generation, slot_nbytes, segments, owner)
        self.pools[(rank, generation)] = pool
        self.collect()
        return pool

    def get(self, rank: int, generation: str, owner: bytes) -> DaemonPool:
        """The live pool ``generation`` of ``rank``, if the connection ``owner`` registered it."""
        pool = self.pools.get((rank, generation))
        if pool is None or pool.retired:
            raise StagingError(f"rank {rank}: no live staging pool {generation} here (the daemon may "
                               "have restarted); the Checkpointer registers a new pool")
        if pool.owner != owner:
            raise StagingError(f"rank {rank}: staging pool {generation} was registered by another "
                               "connection; a rank saves from its own pools only")
        return pool

    def retire_owner(self, owner: bytes) -> None:
        for pool in self.pools.values():
            if pool.owner == owner:
                pool.retired = True
        self.collect()

    def collect(self) -> None:
        """Unlink retired pools that no write uses any more."""
        for key, pool in list(self.pools.items()):
            if pool.retired and not pool.busy:
                self._release(pool)
                del self.pools[key]

    def _release(self, pool: DaemonPool) -> None:
        for seg in pool.segments:
            seg.close()
            seg.unlink()
        log.info("released staging pool %s of rank %d (%d slots)", pool.generation, pool.rank,
                 len(pool.segments))

    def release_all(self) -> None:
        for pool in self.pools.values():
            self._release(pool)
        self.pools.clear()

    def summary(self) -> list[dict]:
        return [{"rank": p.rank, "generation": p.generation, "slots": len(p.segments),
                 "slot_nbytes": p.slot_nbytes, "busy": sorted(p.busy), "retired": p.retired}
                for p in self.pools.values()]
