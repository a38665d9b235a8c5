"""Global checks of what the ranks hold against what they stored, before a commit (pure).

Runs where every rank's records meet, next to :func:`ckptd.format.validate.validate_records`:
rank 0 of a synchronous save, the coordinator of an asynchronous one. Two jobs:

- :func:`dedup_plain`: a plain tensor or value of a DCP-style state dict that several ranks
  wrote (an asynchronous save's ranks write every plain item they hold until they know the
  others hold the same; a synchronous save plans every holder's) is kept once, from the writer
  :func:`ckptd.statedict.holdings.assign_writers` picks; the other copies' bytes stay in their
  data files, unreferenced (DCP and Megatron-Core read only what ``.metadata`` references), as
  torch DCP's ``_dedup_save_plans`` keeps one. Copies whose checksums differ are named in a
  warning. So is a chunk of a DTensor that several ranks store (a DTensor on a submesh is
  replicated across the submeshes), but only once the checksums of its copies are equal.
- :func:`check_coverage`: every key some rank holds (a replica, ``replica_id != 0``, or a plain
  item it left to another rank) must be stored by some rank; otherwise the save is refused,
  naming the key and its holders, as Megatron-Core's ``validate_sharding_integrity`` refuses an
  access pattern without a main replica.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ..errors import ShardingError
from ..statedict.holdings import VALUE, assign_writers
from .records import BYTES, ItemRecord

_NAMED = 5  # keys named in an error; the rest are counted


def is_plain_item(r: ItemRecord) -> bool:
    """Whether ``r`` is a whole plain item of a DCP-style save (a value, or a tensor stored as
    one chunk covering it), which any set of ranks may hold. DCP-style records carry their
    state-dict path; Megatron-style ones (ShardedObjects, common state) do not. A DTensor's chunk
    covering the tensor is none (``replicated``): its copies must be equal."""
    if not r.path or r.replicated:
        return False
    return r.kind == BYTES or (not any(r.offsets) and r.sizes == r.global_shape)


def plain_holdings(records: Iterable[ItemRecord]) -> dict[str, dict[int, int]]:
    """key -> {rank: tensor bytes or VALUE} of the plain items in ``records``."""
    out: dict[str, dict[int, int]] = defaultdict(dict)
    for r in records:
        if is_plain_item(r):
            out[r.fqn][r.rank] = VALUE if r.kind == BYTES else r.nbytes
    return dict(out)


ChunkId = tuple[str, tuple[int, ...], tuple[int, ...]]  # (key, offsets, sizes)


def chunk_id(r: ItemRecord) -> ChunkId:
    return (r.fqn, r.offsets, r.sizes)


def replicated_chunks(records: Sequence[ItemRecord]) -> set[ChunkId]:
    """The chunks (:func:`is_replicated_chunk`) that several ranks store."""
    return set(_replicated_copies(records))


def _replicated_copies(records: Sequence[ItemRecord]) -> dict[ChunkId, list[ItemRecord]]:
    """The records of each chunk (:func:`is_replicated_chunk`) that several ranks store."""
    copies: dict[ChunkId, list[ItemRecord]] = defaultdict(list)
    for r in records:
        if is_replicated_chunk(r):
            copies[chunk_id(r)].append(r)
    return {c: rs for c, rs in copies.items() if len({r.rank for r in rs}) > 1}


def dedup_plain(
    records: Sequence[ItemRecord], writers: Mapping[str, int] | None = None
) -> tuple[list[ItemRecord], list[str]]:
    """``records`` with each plain item kept once (its assigned writer's copy: ``writers``, else
    :func:`~ckptd.statedict.holdings.assign_writers` of the records' holdings), and with each
    replicated chunk kept once (:func:`is_replicated_chunk`: the lowest rank's copy); plus warnings
    naming plain keys whose copies' checksums differ.

    Raises ShardingError when the copies of one key disagree on kind, dtype or shape (the holders
    do not hold the same thing under that key), and when the copies of a replicated chunk have
    other checksums, or any has none (different tensors under one key, which cannot be told
    from copies without them).
    """
    holdings = plain_holdings(records)
    shared = {k for k, held in holdings.items() if len(held) > 1}
    replicated = _replicated_copies(records)
    if not shared and not replicated:
        return list(records), []
    copies: dict[str, list[ItemRecord]] = defaultdict(list)
    for r in records:
        if r.fqn in shared and is_plain_item(r):
            copies[r.fqn].append(r)
    for key, rs in copies.items():
        _check_same_item(key, rs)
    dropped: set[int] = set()
    for chunk, rs in replicated.items():
        _check_same_item(chunk[0], rs)
        _check_same_values(chunk, rs)
        lowest = min(r.rank for r in rs)
        dropped.update(id(r) for r in rs if r.rank != lowest)
    chosen = dict(writers or {})
    if shared - chosen.keys():  # a DTensor's whole-tensor piece held by several ranks is no planned plain key
        chosen = {**assign_writers({k: holdings[k] for k in shared}), **chosen}
    kept = [
        r
        for r in records
        if id(r) not in dropped and (not (r.fqn in shared and is_plain_item(r)) or chosen[r.fqn] == r.rank)
    ]
    warnings = [w for key in sorted(copies) if (w := _differing(key, copies[key], chosen[key]))]
    return kept, warnings


def is_replicated_chunk(r: ItemRecord) -> bool:
    """Whether ``r`` is a part of a DCP-style tensor that other ranks may store too: a DTensor on a
    submesh (``init_device_mesh(("dp", "tp"))["tp"]``, each data-parallel group's tensor-parallel
    ranks) is replicated across the groups, but each group's ranks see only their submesh, so the
    same chunk comes from one rank of every group. As torch DCP's ``_dedup_save_plans`` does, one
    copy is kept, once their checksums show they are copies; Megatron-style chunks (no path) say
    which copy is the main one by replica_id."""
    return bool(r.path) and r.kind != BYTES and not is_plain_item(r)


def _check_same_values(chunk: ChunkId, copies: list[ItemRecord]) -> None:
    """The copies of a replicated chunk hold the same bytes: two pipeline stages whose layers are
    numbered alike (``layers.0`` on both) hold different tensors under one key, which are no copies."""
    key, offsets, _ = chunk
    unknown = sorted(r.rank for r in copies if r.crc is None)
    if unknown:
        raise ShardingError(
            f"tensor '{key}': ranks {_ranks(sorted(r.rank for r in copies))} each store its chunk at offsets "
            f"{list(offsets)}, and without checksums (ranks {_ranks(unknown)}) copies of one tensor (a DTensor "
            "on a submesh) cannot be told from different tensors under one key: turn checksums on "
            "(CkptdConfig(checksums=True), the default), or give each rank's tensor a key of its own"
        )
    by_crc: dict[int | None, list[int]] = defaultdict(list)
    for r in copies:
        by_crc[r.crc].append(r.rank)
    if len(by_crc) > 1:
        said = "; ".join(f"ranks {_ranks(sorted(ranks))}" for ranks in sorted(by_crc.values()))
        raise ShardingError(
            f"tensor '{key}': its chunk at offsets {list(offsets)} is stored by several ranks with different "
            f"values ({said} agree): a key names one tensor. Copies of it (data-parallel replicas of a "
            "DTensor on a submesh) must be equal; different tensors (a pipeline stage's layers numbered "
            "from 0 on every stage) need keys of their own"
        )


def _check_same_item(key: str, copies: list[ItemRecord]) -> None:
    first = copies[0]
    for r in copies[1:]:
        if (r.kind, r.dtype, r.global_shape) != (first.kind, first.dtype, first.global_shape):
            raise ShardingError(
                f"ranks {first.rank} and {r.rank} hold different things under the key '{key}' "
                f"({_what(first)} and {_what(r)}); a key names one tensor or value on every rank "
                "that holds it: rename one of them"
            )


def _what(r: ItemRecord) -> str:
    return "a value" if r.kind == BYTES else f"a {r.dtype} tensor of shape {list(r.global_shape)}"


def _differing(key: str, copies: list[ItemRecord], writer: int) -> str:
    crcs = {r.rank: r.crc for r in copies}
    if None in crcs.values() or len(set(crcs.values())) < 2:
        return ""
    kept = crcs[writer]
    others = sorted(r for r, c in crcs.items() if c != kept)
    rule = "the lowest holding rank's" if copies[0].kind == BYTES else "its size-balanced writer's"
    return (
        f"ranks {sorted(crcs)} hold different copies of '{key}'; only rank {writer}'s is stored "
        f"({rule}); ranks {others} differ from it. Keep one value per key on every rank that "
        "holds it, or give each rank's value a key of its own"
    )


def check_coverage(records: Iterable[ItemRecord], held: Mapping[int, Sequence[str]], hint: str = "") -> None:
    """Raise ShardingError unless every key in ``held`` (rank -> keys it holds without storing
    them) is stored by some record; the error names the keys, their holders and what to do
    (``hint`` adds a cause the caller knows of)."""
    if not any(held.values()):
        return
    stored = {r.fqn for r in records}
    holders: dict[str, list[int]] = {}
    for rank in sorted(held):
        for key in held[rank]:
            if key not in stored:
                holders.setdefault(key, []).append(rank)
    if not holders:
        return
    keys = sorted(holders)
    named = "; ".join(f"'{k}' (held by ranks {_ranks(holders[k])})" for k in keys[:_NAMED])
    more = f" and {len(keys) - _NAMED} more" if len(keys) > _NAMED else ""
    raise ShardingError(
        f"{len(keys)} key(s) would not be stored: {named}{more}. Every rank holding them marks "
        "its copy as a replica (replica_id != 0), so no rank stores it and the checkpoint would "
        "lack it. Give exactly one copy of each replica_id 0 (Megatron-Core: the main replica, "
        "e.g. data-parallel rank 0), or leave the key out of the state dict" + (f". {hint}" if hint else "")
    )


def _ranks(ranks: list[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return str(ranks)
    return f"[{', '.join(map(str, ranks[:limit]))}, ... {len(ranks)} ranks]"


def uniform_digest(digests: Mapping[int, str], world_size: int) -> str:
    """The plain-key digest every one of ``world_size`` ranks sent, or "" when they differ (or
    some rank sent none)."""
    values = {digests.get(r, "") for r in range(world_size)}
    return values.pop() if len(values) == 1 else ""


def settle(
    records: Mapping[int, Sequence[ItemRecord]],
    held: Mapping[int, Sequence[str]],
    digests: Mapping[int, str],
) -> tuple[dict[int, list[ItemRecord]], list[str]]:
    """An asynchronous save's records once every rank reported (rank -> its stored records, the
    keys it holds without storing them, its plain-key digest): each plain item kept once
    (:func:`dedup_plain`), per rank, and the warnings; raises ShardingError when the records do not
    store every held key (:func:`check_coverage`)."""
    flat = [r for rank in sorted(records) for r in records[rank]]
    kept, warnings = dedup_plain(flat)
    hint = ""
    if len(set(digests.values())) > 1:
        hint = (
            "If such a key is a plain tensor or value of a DCP-style state dict: the ranks' plain "
            "keys changed since a save that found them equal on every rank, so ranks left keys to "
            "ranks that no longer hold them; from the next save on every rank stores all it holds "
            "again: save again"
        )
    check_coverage(kept, held, hint)
    out: dict[int, list[ItemRecord]] = {rank: [] for rank in records}
    for r in kept:
        out[r.rank].append(r)
    return out, warnings
