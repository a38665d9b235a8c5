"""Backpressure: what a rank does when its staging ring has no room for a save yet.

Pure functions of the ring's state (:mod:`ckptd.staging.ring`): ``consumed`` (every virtual byte
below it is on disk), the save's virtual range ``[start, end)`` and the ring's ``capacity``. A save
*fits* once ``consumed >= end - capacity``: its producer can then write every byte without
waiting. The ring is *busy* while earlier saves still hold it: their bytes are not all on disk
yet (``consumed < start``, the start of the next save being the end of the last one), or all
``BLOCKS`` control blocks are taken.

- ``on_full="skip"`` (:func:`must_skip`): a save is skipped only when the ring is busy and the
  save does not fit. On an idle ring a save of any size is taken, and one larger than the ring
  streams through it as with ``on_full="wait"``: skipping it would skip every save of that size
  forever, on an idle disk too (a budget below ``1x``, or a state grown past the ring).
- Fork snapshots (:func:`may_fork`): a forked child keeps its copy-on-write view of the trainer's
  memory until it has copied its last item, so a child waiting for ring space costs memory (every
  page training writes meanwhile exists twice) for as long as the disk is behind. At most one
  child per rank may wait for space: a save whose child would wait while an earlier child still
  waits waits in ``save()`` first (ckptd.staging.children), until the earlier child has its room.
"""

from __future__ import annotations

from collections.abc import Iterable


def fits(consumed: int, end: int, capacity: int) -> bool:
    """Whether the producer of a save ending at virtual ``end`` can write all of it now."""
    return consumed >= end - capacity


def must_skip(*, free_block: bool, consumed: int, start: int, end: int, capacity: int) -> bool:
    """``on_full="skip"``: whether to skip the save laid out at ``[start, end)``, the next range of
    the ring. Only when earlier saves still hold the ring (no free control block, or bytes of
    theirs not on disk yet) and this save does not fit beside them."""
    if not free_block:
        return True
    return not fits(consumed, end, capacity) and consumed < start


def may_fork(*, consumed: int, capacity: int, end: int, earlier_ends: Iterable[int]) -> bool:
    """Whether a fork snapshot of the save ending at ``end`` may start now, given the ends of the
    saves whose children still run: yes when its child will not wait for ring space, or when no
    earlier child waits (so at most one child per rank waits for space at any time)."""
    if fits(consumed, end, capacity):
        return True
    return all(fits(consumed, e, capacity) for e in earlier_ends)
