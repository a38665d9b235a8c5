"""A save produced into a real staging ring, as the node daemon sees it (no daemon process).

The rank side creates its ring in /dev/shm and produces the items inline (as ``snapshot="copy"``
does, sealed at the end); the daemon side maps the same segment by name and gets the
:class:`WriteRequest` and :class:`SnapshotWait` that ``write_rank_file`` needs.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from ckptd.daemon.rings import RingTable
from ckptd.daemon.snapshot import SnapshotWait
from ckptd.daemon.workers import WriteRequest
from ckptd.format.items import PlannedItem
from ckptd.staging.devcopy import copy_inline
from ckptd.staging.producer import start_block
from ckptd.staging.rankside import StagingRing, place
from ckptd.staging.ring import RingMap, block_offset
from ckptd.staging.segment import unlink_segments


class ProducedSave(NamedTuple):
    ring: RingMap  # the daemon's mapping
    request: WriteRequest
    wait: SnapshotWait


@contextmanager
def produced_save(step: int, items: list[PlannedItem], capacity: int = 1 << 20) -> Iterator[ProducedSave]:
    """Produce ``items`` as rank 0's save of ``step`` into a fresh ring of ``capacity`` bytes;
    every segment is unlinked on exit (the test fails if one leaked)."""
    prefix = f"ckptd-test{secrets.token_hex(3)}-n0-"
    ring = StagingRing.create(prefix, 0, capacity=capacity, timeout_s=30)
    table = RingTable(prefix)
    try:
        daemon_ring = table.register(0, ring.generation, ring.capacity, ring.names, b"test")
        placements, _ = place(items)
        block, start = ring.claim(placements)
        seal = start_block(ring, block)
        copy_inline(ring, start, block, items, placements, seal)
        req = WriteRequest(
            step=step, rank=0, records=[i.record for i in items], placements=placements, common=None, ring_start=start
        )
        yield ProducedSave(daemon_ring.map, req, SnapshotWait.open(0, os.getpid(), seal, block_offset(block)))
    finally:
        ring.close(unlink=False)
        table.release_all()
        leaked = unlink_segments(prefix)
    if leaked:
        raise AssertionError(f"the test leaked staging segments {leaked}")
