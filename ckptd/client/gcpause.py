"""Keep Python's cyclic garbage collector out of a short, allocation-heavy call.

``Checkpointer.save`` creates several short-lived objects per saved item (records, placements,
wire maps): thousands for a large state dict. With the collector on, the young collections that
these allocations trigger promote whatever is alive at that moment to older generations, and
every few saves that starts a *full* collection, which walks the whole heap of the trainer
(0.1-0.3 s with torch imported, more with a big model). Paused, the temporaries are freed by
reference counting before anything is collected, so the save triggers no collection at all:
the cost is avoided, not moved. Objects a save leaves behind are collected normally afterwards.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


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
