"""Control-plane messages for tests: a valid SAVE or WRITTEN from one call that names only the fields
the test is about.

The messages (ckptd.control.protocol) are keyword-only dataclasses whose fields mostly have no
default, so that the package never sends one by accident; a test that only needs *a* valid message
takes the rest from here: rank 0 of a world of 1, attempt :data:`ATTEMPT`, nothing stored, no
common state, no snapshot child.
"""

from __future__ import annotations

from typing import Any

from ckptd.control.protocol import Save, Written
from ckptd.staging.ring import block_offset

ATTEMPT = "0123456789ab-1"
_RANK_0_OF_1 = {"step": 1, "attempt": ATTEMPT, "rank": 0, "world_size": 1}


def a_save(**changes: Any) -> Save:
    """A valid SAVE of step 1 by rank 0 of 1 from ring ``"g"``'s block 0 (its seal in the block it
    names, unless ``changes`` say otherwise), with ``changes``."""
    fields: dict[str, Any] = {
        **_RANK_0_OF_1,
        "generation": "g",
        "block": 0,
        "items": [],
        "common": None,
        "common_digest": "",
        "layout": "",
        "ring_start": 0,
        "snapshot_pid": 0,
        "seal": b"",
        "seal_offset": None,  # its block's
    }
    fields.update(changes)
    if fields["seal_offset"] is None:
        fields["seal_offset"] = block_offset(fields["block"])
    return Save(**fields)


def a_written(**changes: Any) -> Written:
    """A valid WRITTEN of step 1 by rank 0 of 1 on node 0 (no records, an empty file), with ``changes``."""
    fields: dict[str, Any] = {
        **_RANK_0_OF_1,
        "node": 0,
        "records": [],
        "common": None,
        "common_digest": "",
        "file_nbytes": 0,
    }
    return Written(**{**fields, **changes})
