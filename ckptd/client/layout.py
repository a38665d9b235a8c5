"""Sending a save's item list once: later saves with the same structure send only its id.

A training job saves the same state structure again and again: same keys, shapes, dtypes and
shard offsets, so the same records at the same offsets in the ring (and the same keys held as
replicas). Encoding, sending, decoding and
checking every record each time costs ~2-4 us per item on the rank and ~7 us on the daemon
(10,000 small tensors: tens of milliseconds of the training stall). The rank remembers the last item list it sent for
its ring; when the next save's records and placements are equal, the SAVE carries only the
layout id and the daemon reuses what it decoded and checked before (ckptd.daemon.rings).
``prepare()`` sends the item list ahead (REGISTER_LAYOUT), so even the first save sends only the id.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from ..control.protocol import RegisterLayout, SaveItem
from ..format.items import PlannedItem
from ..format.records import ItemRecord
from ..staging.rankside import Placement


@dataclass
class LayoutCache:
    """The item list this rank last sent for ring ``generation`` under ``layout_id``."""

    generation: str = ""
    layout_id: str = ""
    records: tuple[ItemRecord, ...] = ()
    placements: tuple[Placement, ...] = field(default_factory=tuple)
    held: tuple[str, ...] = ()

    def items_for(
        self, generation: str, items: list[PlannedItem], placements: list[Placement], held: list[str]
    ) -> tuple[list[SaveItem], str, list[str]]:
        """``(items, layout, held)`` fields of the SAVE for these items and held keys (see
        :class:`~ckptd.control.protocol.Save`): a layout equal to the last one sends neither."""
        if not items:
            return [], "", held
        records = tuple(it.record for it in items)
        placed = tuple(placements)
        kept = tuple(held)
        if (
            self.layout_id
            and generation == self.generation
            and records == self.records
            and placed == self.placements
            and kept == self.held
        ):
            return [], self.layout_id, []
        wire = [SaveItem(record=r, offset=p.offset, nbytes=p.nbytes) for r, p in zip(records, placed)]
        self.generation, self.records, self.placements, self.held = generation, records, placed, kept
        self.layout_id = secrets.token_hex(8)
        return wire, self.layout_id, held

    def forget(self) -> None:
        """The daemon may not hold the last layout (it refused the SAVE, or restarted)."""
        self.layout_id = ""

    def register(
        self,
        request: Callable[[RegisterLayout], object],
        rank: int,
        generation: str,
        items: list[PlannedItem],
        placements: list[Placement],
        held: list[str],
    ) -> None:
        """Send the daemon the item list of the saves to come, ahead of the first one, with
        ``request`` (a REGISTER_LAYOUT, answered by LAYOUT_OK or raising); nothing when the daemon
        holds it already. A failed request leaves no layout for the next SAVE to name."""
        wire, layout, kept = self.items_for(generation, items, placements, held)
        if not wire:
            return
        try:
            request(RegisterLayout(rank=rank, generation=generation, layout=layout, items=wire, held=kept))
        except BaseException:
            self.forget()
            raise
