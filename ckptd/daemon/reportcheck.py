"""Checking a rank's WRITTEN against the attempt it reports, before the coordinator counts it.

Part of the coordinator's pure decisions (ckptd.daemon.commitstate): a report must agree with the
attempt's world size, name a rank inside it, carry well-formed records (ckptd.control.itemchecks)
of that rank only, all stored in the rank's data file of the attempt and inside the size the
report gives that file. A rank's second report of the attempt counts as a repeat when identical
to the first (a node's resend), and as a contradiction otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..control.itemchecks import check_record
from ..control.protocol import Written
from ..errors import ProtocolError
from ..format.records import ItemRecord
from .commitevents import AttemptState

log = logging.getLogger(__name__)


def checked_records(
    st: AttemptState, msg: Written, data_file_name: Callable[[str, int], str]
) -> list[ItemRecord] | None:
    """The records of ``msg`` once checked against its attempt ``st`` (``data_file_name``: the
    root's naming of a rank's data file); None for an identical repeat (logged). Raises
    ProtocolError (the attempt aborts) for a report that contradicts the attempt or itself."""
    if msg.world_size != st.world_size:
        raise ProtocolError(
            f"world size {msg.world_size}, other ranks of attempt {msg.attempt} "
            f"said {st.world_size}; every rank of the job must use one "
            "Checkpointer setup"
        )
    if not 0 <= msg.rank < st.world_size:
        raise ProtocolError(f"rank {msg.rank} outside world size {st.world_size}")
    for rec in msg.records:
        check_record(rec)
    records = msg.records
    if msg.rank in st.records:
        if (
            records == st.records[msg.rank]
            and msg.file_nbytes == st.file_nbytes[msg.rank]
            and (msg.rank != 0 or msg.common == st.common)
        ):
            log.warning(
                "step %d attempt %s: ignored a repeated WRITTEN of rank %d (node %d)",
                msg.step,
                msg.attempt,
                msg.rank,
                msg.node,
            )
            return None
        raise ProtocolError(f"rank {msg.rank} reported attempt {msg.attempt} of step {msg.step} twice, differently")
    name = data_file_name(msg.attempt, msg.rank)
    for r in records:
        if r.rank != msg.rank:
            raise ProtocolError(f"rank {msg.rank} sent records of rank {r.rank}")
        if r.relative_path != name:
            raise ProtocolError(
                f"rank {msg.rank} sent a record stored in {r.relative_path!r}, not in its data file {name}"
            )
    end = max((r.file_offset + r.length for r in records), default=0)
    if msg.file_nbytes < end:
        raise ProtocolError(
            f"rank {msg.rank}'s data file {name} has {msg.file_nbytes} bytes, but its records address {end}"
        )
    return records
