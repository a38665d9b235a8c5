"""Keep Python's cyclic garbage collector out of a short, allocation-heavy call.

``Checkpointer.save`` creates several short-lived objects per saved item (records, placements,
wire maps): thousands for a large state dict. With the collector on, the young collections that
these allocations trigger promote whatever is alive at that moment to older generations, and
every few saves that starts a *full* collection, which walks the whole heap of the trainer
(0.1-0.3 s with torch imported, more with a big model). Paused, the temporaries are freed by
reference counting before anything is collected, so the save triggers no collection at all:
the cost is avoided, not moved. Objects a save leaves behind are collected normally afterwards.

The coordinator pauses it likewise while it commits: a commit of 4,096 ranks builds ~20 objects
per record, and each full collection those allocations trigger walks every record still held, so
collections cost O(ranks^2) per commit (a third of the commit's CPU at 4,096 ranks, 0.14 of
0.42 s).

The pause is process-wide: with two threads pausing at once the collector may run again before
the later one ends (never staying off once both ended, unless it was off before).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block (re-enabled after, if it was enabled)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
