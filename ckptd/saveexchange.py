"""The planning exchange of a synchronous save (step 2 of :func:`ckptd.api.save`): what each rank
sends, and what every rank decides alike from what all sent.

Each rank sends its planned records (:func:`planned_record`: a plain value's with the CRC-32C of
its bytes, as ranks' copies of it may differ), the style of its state dict
(:func:`reported_dialect`), the plain items it holds and a digest of its common state. From them,
every rank refuses a mix of styles (:func:`check_one_dialect`), picks the rank that writes each
plain item several hold (:func:`plain_writers`), compares the copies of chunks several ranks store
(:func:`with_replicated_crcs`, a collective only when there are such chunks), and logs when a
rank's common state differs from rank 0's, the one saved (:func:`warn_differing_common`).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from .dist import DistContext
from .errors import ShardingError
from .format.checksum import crc32c
from .format.coverage import ChunkId, chunk_id, is_replicated_chunk, replicated_chunks
from .format.items import PlannedItem, payload_crc
from .format.records import BYTES, ItemRecord
from .mapping import ByteItem
from .statedict.digest import differing_ranks
from .statedict.holdings import assign_writers
from .statedict.split import Dialect, SplitStateDict

log = logging.getLogger(__name__)


def with_replicated_crcs(
    ctx: DistContext, by_rank: list[list[ItemRecord]], prepared: list[PlannedItem]
) -> list[list[ItemRecord]]:
    """Every rank's planned records, those of chunks several ranks store (a DTensor on a submesh)
    with the CRC-32C of their values (a collective, only when there are such chunks): their copies
    are kept once only when equal (ckptd.format.coverage.dedup_plain)."""
    several = replicated_chunks([r for records in by_rank for r in records])
    if not several:
        return by_rank

    def mine() -> dict[ChunkId, int]:
        return {
            chunk_id(r): payload_crc(item.payload)
            for item, r in zip(prepared, by_rank[ctx.rank], strict=True)
            if is_replicated_chunk(r) and chunk_id(r) in several
        }

    crcs = ctx.agree("comparing the copies of chunks several ranks store", mine)
    return [
        [
            replace(r, crc=crcs[rank][chunk_id(r)]) if is_replicated_chunk(r) and chunk_id(r) in several else r
            for r in records
        ]
        for rank, records in enumerate(by_rank)
    ]


def planned_record(item: PlannedItem, plain: dict[str, int], world_size: int) -> ItemRecord:
    """A planned record for the planning exchange; a plain value held by several ranks may
    differ between them, so its bytes' CRC-32C goes along (rank 0 warns about differing copies)."""
    record = item.record
    if world_size > 1 and record.kind == BYTES and record.fqn in plain and isinstance(item.payload, bytes):
        record = replace(record, crc=crc32c(item.payload))
    return record


def plain_writers(plains: list[dict[str, int]]) -> dict[str, int]:
    """Who writes each plain item, from every rank's plain items (key -> bytes or VALUE)."""
    holdings: dict[str, dict[int, int]] = {}
    for rank, plain in enumerate(plains):
        for key, nbytes in plain.items():
            holdings.setdefault(key, {})[rank] = nbytes
    return assign_writers(holdings)


def warn_differing_common(digests: list[str | None], rank: int, where: str) -> None:
    """Log (on rank 0 and on each differing rank) when a rank's common state differs from rank 0's,
    which is the one saved."""
    differing = differing_ranks(digests)
    if not differing:
        return
    if rank == 0:
        log.warning(
            "save of %s: the common state of ranks %s differs from rank 0's; only rank 0's "
            "is saved (keep per-rank values in ShardedObjects)",
            where,
            differing,
        )
    elif rank in differing:
        log.warning(
            "save of %s: this rank's (%d) common state differs from rank 0's, which is the one "
            "saved; keep per-rank values in ShardedObjects",
            where,
            rank,
        )


def reported_dialect(split: SplitStateDict) -> str | None:
    """The style of a rank's state dict as the exchange carries it; None: a rank with no tensor or
    sharded entry (only plain values, or nothing) takes the others' style."""
    if split.dialect is Dialect.MEGATRON or any(not isinstance(sh, ByteItem) for sh in split.sharded.values()):
        return split.dialect.value
    return None


def check_one_dialect(dialects: list[str | None]) -> None:
    """Every rank's state dict is of one style (every rank raises alike): a Megatron-style one
    (ShardedTensor, ShardedObject...) keeps its common state in ``common.pt``, which rank 0 writes,
    and a DCP-style one stores every value as an item. Mixed, rank 0's common state was lost when
    rank 0 was the DCP-style one, with only a warning that the common state differed."""
    styles = {d for d in dialects if d is not None}
    if len(styles) > 1:
        by = {d: [r for r, x in enumerate(dialects) if x == d] for d in sorted(styles)}
        said = "; ".join(f"ranks {ranks} {d}-style" for d, ranks in by.items())
        raise ShardingError(
            f"the ranks' state dicts are of different styles ({said}): a Megatron-style state dict holds a "
            "ShardedTensor, ShardedObject or factory, a DCP-style one plain tensors or DTensors. Give every "
            "rank the same structure"
        )
