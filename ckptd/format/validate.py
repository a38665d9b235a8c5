"""Global checks of all ranks' item records before anything becomes visible.

Runs where every rank's records meet: rank 0 of a synchronous save, or the coordinator of an
asynchronous one. Errors name the key and the ranks involved.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence

from ..errors import ShardingError
from .geometry import OverlapCheckRefused, find_overlap
from .objectkey import object_key_parts
from .records import BYTES, TENSOR, ItemRecord


def _check_no_overlap(fqn: str, chunks: list[ItemRecord]) -> None:
    seen: dict[tuple[int, ...], ItemRecord] = {}
    for c in chunks:
        if c.offsets in seen:
            other = seen[c.offsets]
            raise ShardingError(
                f"tensor '{fqn}': ranks {other.rank} and {c.rank} both store the chunk at offsets "
                f"{c.offsets}. Give all but one of them replica_id != 0, or fix their offsets."
            )
        seen[c.offsets] = c
    try:
        found = find_overlap(chunks, f"tensor '{fqn}'")
    except OverlapCheckRefused as exc:
        # Raised as what the rest of this check raises: at a commit the layout is the job's own,
        # and `ckptd verify` reports it as a damaged checkpoint's.
        raise ShardingError(
            f"tensor '{fqn}': its {exc.count} chunks vary on several axes at once, and not as a "
            f"grid, so checking that no two overlap was stopped after {exc.budget} steps (grids and "
            "flattened ranges take a few per chunk). A saved checkpoint with this layout has a "
            "damaged or crafted .metadata: load an earlier one; a save with it should shard the "
            "tensor as a grid."
        ) from None
    if found is not None:
        a, b = found
        raise ShardingError(
            f"tensor '{fqn}': the chunk of rank {a.rank} (offsets {a.offsets}, sizes "
            f"{a.sizes}) overlaps the chunk of rank {b.rank} (offsets {b.offsets}, sizes "
            f"{b.sizes}). Each element must be stored by exactly one main replica."
        )


def validate_records(records: list[ItemRecord], *, objects: bool = True) -> None:
    """Raise ShardingError unless the records describe a complete, consistent checkpoint.

    Checks: each key has one kind, one dtype and one global shape on every rank; chunks lie in
    bounds; no two chunks overlap; chunks cover the whole tensor (no gap); ShardedObject keys are
    stored once; with ``objects`` (a save's records, all of them), every ShardedObject has one
    global shape and all its shards (as Megatron-Core checks).
    """
    if objects:
        _check_object_shards(records)
    by_key: dict[str, list[ItemRecord]] = defaultdict(list)
    for r in records:
        by_key[r.fqn].append(r)
    for fqn, items in by_key.items():
        kinds = {r.kind for r in items}
        if len(kinds) > 1:
            ranks = sorted({r.rank for r in items})
            raise ShardingError(
                f"key '{fqn}' is a tensor on some ranks and an object on others (ranks {ranks}); use distinct keys"
            )
        if BYTES in kinds:
            if len(items) > 1:
                raise ShardingError(
                    f"ShardedObject '{fqn}' is stored by ranks {sorted(r.rank for r in items)}; "
                    "give all but one of them replica_id != 0"
                )
            continue
        _validate_tensor(fqn, items)


def _check_object_shards(records: list[ItemRecord]) -> None:
    """Every ShardedObject (a save's byte item keyed ``<key>/shard_<offsets>_<shape>``, without
    the DCP path a plain value carries) has one global shape on every rank and a main replica of
    each of its ``prod(shape)`` shards. A shard no rank stored used to pass: the save succeeded
    and the load of that shard found nothing."""
    # key -> global shape -> (record, its offsets)
    shards: dict[str, dict[tuple[int, ...], list[tuple[ItemRecord, tuple[int, ...]]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in records:
        parsed = object_key_parts(r.fqn) if r.kind == BYTES and not r.path else None
        if parsed is not None and len(parsed[1]) == len(parsed[2]):
            key, offsets, shape = parsed
            shards[key][shape].append((r, offsets))
    for key, by_shape in shards.items():
        if len(by_shape) > 1:
            said = "; ".join(
                f"{shape} by ranks {sorted({r.rank for r, _ in rs})}" for shape, rs in sorted(by_shape.items())
            )
            raise ShardingError(f"ShardedObject '{key}' has several global shapes: {said}; all ranks must agree")
        ((shape, stored),) = by_shape.items()
        expected = math.prod(shape)
        if len(stored) != expected:
            have = {offsets for _, offsets in stored}
            missing = next((o for o in itertools.product(*(range(n) for n in shape)) if o not in have), None)
            raise ShardingError(
                f"ShardedObject '{key}' of global shape {shape}: {len(stored)} of its {expected} shards are "
                f"stored by ranks {sorted({r.rank for r, _ in stored})}"
                + (f" (shard {missing} by none)" if missing is not None else "")
                + "; every shard needs a rank that holds it with replica_id 0"
            )


def _validate_tensor(fqn: str, items: list[ItemRecord]) -> None:
    first = items[0]
    for r in items[1:]:
        if r.global_shape != first.global_shape:
            raise ShardingError(
                f"tensor '{fqn}': rank {first.rank} declares global shape {first.global_shape} but "
                f"rank {r.rank} declares {r.global_shape}; all ranks must agree"
            )
        if r.dtype != first.dtype:
            raise ShardingError(
                f"tensor '{fqn}': rank {first.rank} stores {first.dtype} but rank {r.rank} stores "
                f"{r.dtype}; all ranks must use one dtype"
            )
    for r in items:
        if not len(r.offsets) == len(r.sizes) == len(r.global_shape):
            raise ShardingError(
                f"tensor '{fqn}': the chunk of rank {r.rank} has offsets {r.offsets} and sizes "
                f"{r.sizes} for the {len(r.global_shape)}-D global shape {r.global_shape}"
            )
        for axis, (o, s, g) in enumerate(zip(r.offsets, r.sizes, r.global_shape)):
            if o < 0 or s < 0 or o + s > g:
                raise ShardingError(
                    f"tensor '{fqn}': the chunk of rank {r.rank} spans [{o}, {o + s}) on axis "
                    f"{axis}, outside the global shape {r.global_shape}"
                )
    _check_no_overlap(fqn, items)
    covered = sum(math.prod(r.sizes) for r in items)
    total = math.prod(first.global_shape)
    if covered != total:
        ranks = sorted({r.rank for r in items})
        hole = _uncovered_element(items)
        where = f" (element {hole} is stored by no rank)" if hole is not None else ""
        raise ShardingError(
            f"tensor '{fqn}': the main replicas (replica_id 0) on ranks {ranks} cover {covered} of "
            f"{total} elements of global shape {first.global_shape}{where}; some chunk is missing. "
            "Check the offsets, and that every chunk has a rank with replica_id 0."
        )


def _uncovered_element(items: list[ItemRecord], limit: int = 4096) -> tuple[int, ...] | None:
    """An element no chunk covers, for the error message (None if too costly to find).

    The first uncovered element in row-major order has, on every axis, coordinate 0 or the end
    of some chunk, so only those candidates are tried.
    """
    shape = items[0].global_shape
    axes = [
        sorted({0} | {o + s for r in items for o, s in [(r.offsets[a], r.sizes[a])] if o + s < n})
        for a, n in enumerate(shape)
    ]
    if any(n == 0 for n in shape) or math.prod(len(c) for c in axes) > limit:
        return None
    for point in itertools.product(*axes):
        if not any(all(o <= p < o + s for p, o, s in zip(point, r.offsets, r.sizes)) for r in items):
            return point
    return None


def check_local_duplicates(records: Sequence[ItemRecord], rank: int) -> None:
    """Cheap rank-local check run before any collective: one item per key and offset."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for r in records:
        ident = (r.fqn, r.offsets if r.kind == TENSOR else ())
        if ident in seen:
            raise ShardingError(f"rank {rank} stores {r.where()} twice; give the duplicate replica_id != 0")
        seen.add(ident)
