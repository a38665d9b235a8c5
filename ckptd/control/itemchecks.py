"""What the types of a SAVE's items and a WRITTEN's records cannot say (ckptd.control.protocol
decodes every field's type): checked where the message is handled, so that a SAVE is answered
with an ERROR and a WRITTEN aborts its attempt, naming the problem."""

from __future__ import annotations

from ..errors import ProtocolError, StagingError
from ..format.checksum import block_count
from ..format.records import BYTES, TENSOR, ItemRecord, check_dtype_name
from .protocol import MAX_RING_OFFSET, SaveItem


def check_record(rec: ItemRecord) -> None:
    """ProtocolError unless ``rec`` is a record ckptd can store: its kind, and for a tensor a
    dtype it knows and shapes of equal rank (what the record's types cannot say)."""
    if rec.kind == TENSOR:
        check_dtype_name(rec.dtype)
        if not len(rec.global_shape) == len(rec.offsets) == len(rec.sizes):
            raise ProtocolError(f"malformed item record for {rec.fqn!r}: rank mismatch of shapes")
    elif rec.kind != BYTES:
        raise ProtocolError(f"malformed item record for {rec.fqn!r}: unknown kind {rec.kind!r}")
    if rec.block_crcs and len(rec.block_crcs) != 4 * block_count(rec.length):
        raise ProtocolError(
            f"malformed item record for {rec.fqn!r}: {len(rec.block_crcs)} bytes of block checksums for "
            f"{rec.length} stored bytes"
        )


def check_save_items(rank: int, items: list[SaveItem], capacity: int) -> None:
    """What the types of a SAVE's (or REGISTER_LAYOUT's) items cannot say: valid records
    (:func:`check_record`) of the sending ``rank``, placed in order without overlap, each no larger
    than the ring (``capacity`` bytes) and each tensor's size its shape's. ProtocolError, or
    StagingError for a placement."""
    end = 0
    for it in items:
        rec, off, n = it.record, it.offset, it.nbytes
        check_record(rec)
        if not (end <= off < MAX_RING_OFFSET and 0 <= n <= capacity):
            raise StagingError(
                f"rank {rank}: item {rec.fqn!r} at {off} ({n} bytes) overlaps the one "
                f"before it or does not fit the {capacity}-byte ring"
            )
        end = off + n
        if rec.rank != rank:
            raise ProtocolError(f"rank {rank} sent a record of rank {rec.rank}")
        if rec.kind == TENSOR and rec.nbytes != n:
            raise StagingError(f"rank {rank}: item {rec.fqn!r} has {n} bytes, its shape needs {rec.nbytes}")
