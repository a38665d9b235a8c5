"""Planning one rank's save: which items it stores, each a record plus the payload to write.

:func:`plan_rank` turns a split state dict (:mod:`ckptd.statedict.split`) into the rank's
:class:`~ckptd.format.items.PlannedItem` list and the keys it holds without storing them
(replicas), checking locally what can be checked without the
other ranks (data present, metadata consistent, no duplicate within the rank); global coverage is
checked later, by rank 0 of a synchronous save (:func:`ckptd.save`) or by the coordinator of an
asynchronous one. Both kinds of save plan with it; an asynchronous Checkpointer passes a
:class:`PlanCache` so that its repeated saves of an unchanged structure reuse the checked records.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from ..errors import ShardingError
from ..mapping import ByteItem, ShardedTensor, is_main_replica
from ..statedict.split import SplitStateDict
from ..statedict.tree import path_str
from .items import (
    PlannedItem,
    piece_starts,
    plan_bytes,
    plan_object,
    plan_tensor_items,
    tensor_payloads,
)
from .records import TENSOR, ItemRecord, dtype_name
from .validate import check_local_duplicates


class _PlanEntry(NamedTuple):
    """What one ShardedTensor's last save planned."""

    signature: tuple  # :func:`_tensor_signature` and the DCP path
    records: tuple[ItemRecord, ...]  # checked
    starts: tuple[int, ...]  # the flat start of each record's piece
    direct: bool  # its single item's payload is ``data`` itself


@dataclass
class PlanCache:
    """What :func:`plan_save` may reuse on a Checkpointer's next save.

    ``entries``: per state-dict path of a ShardedTensor, what its last save planned.
    ``checked``: the last record list that passed the duplicate check.
    ``values``: per state-dict path of a plain value saved as a DCP bytes item, a frozen copy of
    it (:func:`frozen_value`) and its planned item: an equal value reuses the serialized bytes.
    """

    entries: dict[Any, _PlanEntry] = field(default_factory=dict)
    checked: tuple[ItemRecord, ...] = ()
    values: dict[Any, tuple[Any, PlannedItem]] = field(default_factory=dict)


@dataclass(frozen=True)
class RankPlan:
    """What one rank stores: ``items``; and ``held``, the keys (unique keys of ShardedObjects) it
    holds but stores no item of: replicas (``replica_id != 0``) and plain items left to another
    rank. The global coverage check (:mod:`ckptd.format.coverage`) refuses a checkpoint in which
    some rank's held key is stored by nobody."""

    items: list[PlannedItem]
    held: list[str]


def plan_save(split: SplitStateDict, rank: int, cache: PlanCache | None = None) -> list[PlannedItem]:
    """:func:`plan_rank`'s items (every plain item written)."""
    return plan_rank(split, rank, cache).items


def plan_rank(
    split: SplitStateDict, rank: int, cache: PlanCache | None = None, *, skip: frozenset[str] = frozenset()
) -> RankPlan:
    """Items this rank stores, in state-dict order: main replicas, and every plain item of a
    DCP-style split (``split.dcp_plain``) except those keyed in ``skip`` (another rank writes
    them, see :mod:`ckptd.statedict.holdings`).

    Raises ShardingError (naming key and rank) for data that cannot be saved: a ShardedTensor
    without data, with non-tensor or meta data, or a ShardedObject that cannot be pickled.
    With a ``cache`` (a Checkpointer's, across its saves), a ShardedTensor whose metadata, data
    shape, dtype and device equal the previous save's at the same path reuses that save's
    checked records: only its payload views are made again; and a record list equal to the last
    one checked is not checked for duplicates again.
    """
    items: list[PlannedItem] = []
    held: list[str] = []
    fresh: dict[Any, _PlanEntry] = {}
    fresh_values: dict[Any, tuple[Any, PlannedItem]] = {}
    old = cache.entries if cache is not None else {}
    whole_tensors = split.dcp_plain
    for path, sh in split.sharded.items():
        if isinstance(sh, ShardedTensor):
            if skip and sh.key in skip:
                _check_tensor_data(sh, path, rank)
                held.append(sh.key)
                continue
            if not is_main_replica(sh.replica_id):
                held.append(sh.key)
            first = len(items)
            dcp_path = split.dcp_paths.get(sh.key, ())
            # With the DCP path: {"a": [t]} and {"a": {0: t}} have one state-dict path, not one DCP path.
            sig = (_tensor_signature(sh), dcp_path) if cache is not None and type(sh.data) is torch.Tensor else None
            hit = old.get(path) if sig is not None else None
            if hit is not None and hit.signature == sig:
                if hit.direct:
                    items.append(PlannedItem(hit.records[0], sh.data))  # type: ignore[arg-type]
                else:
                    items.extend(
                        PlannedItem(r, p) for r, p in zip(hit.records, tensor_payloads(sh, hit.records, hit.starts))
                    )
            elif whole_tensors.get(sh.key) is sh and _plain_dense(sh.data):
                # A DCP-style plain tensor, whole by construction (ShardedTensor.whole): its one
                # record as plan_tensor_items makes it, without checking what holds by construction.
                shape = sh.local_shape
                record = ItemRecord(
                    fqn=sh.key,
                    kind=TENSOR,
                    rank=rank,
                    dtype=dtype_name(sh.dtype, sh.key),
                    global_shape=shape,
                    offsets=sh.global_offset,
                    sizes=shape,
                    path=dcp_path,
                )
                planned = [PlannedItem(record, sh.data)]  # type: ignore[arg-type]
                items.append(planned[0])
                if sig is not None:
                    hit = _PlanEntry(sig, (record,), (0,), True)
            else:
                _check_tensor_data(sh, path, rank)
                planned = plan_tensor_items(sh, rank, dcp_path) if is_main_replica(sh.replica_id) else []
                if path in split.dtensors:
                    planned = [replace(i, record=replace(i.record, replicated=True)) for i in planned]
                items.extend(planned)
                if sig is not None:
                    hit = _PlanEntry(
                        sig,
                        tuple(i.record for i in planned),
                        piece_starts(sh) if planned else (),
                        len(planned) == 1 and planned[0].payload is sh.data,
                    )
            if sig is not None:
                fresh[path] = hit  # type: ignore[assignment]
            watch = split.dtensors.get(path)
            if watch is not None:
                items[first:] = [replace(i, watch=watch) for i in items[first:]]
        elif isinstance(sh, ByteItem):
            if skip and sh.key in skip:
                held.append(sh.key)
            else:
                # Plain values (a DCP-style state dict's step, learning rate, param_groups...) are
                # mostly the same every save, and pickling each costs ~0.5 ms (torch.save): an
                # equal value reuses the last save's bytes, which would be the same.
                frozen = frozen_value(sh.data) if cache is not None else None
                prev = cache.values.get(path) if cache is not None and frozen is not None else None
                item = prev[1] if prev is not None and prev[0] == frozen else None
                dcp_path = split.dcp_paths.get(sh.key, ())
                if item is None or item.record.fqn != sh.key or item.record.path != dcp_path:
                    item = plan_bytes(sh, rank, dcp_path)
                if frozen is not None:
                    fresh_values[path] = (frozen, item)
                items.append(item)
        elif is_main_replica(sh.replica_id):
            items.append(plan_object(sh, rank))
        else:
            held.append(sh.unique_key)
    records = tuple(i.record for i in items)
    # Equal records pass the check equally; the comparison is by identity for reused records.
    if cache is None or records != cache.checked:
        check_local_duplicates(records, rank)
    if cache is not None:
        cache.entries = fresh
        cache.checked = records
        cache.values = fresh_values
    if held:
        written = {r.fqn for r in records}
        held = [k for k in dict.fromkeys(held) if k not in written]
    return RankPlan(items, held)


_PLAIN = (bool, int, float, str, bytes, type(None))


def frozen_value(value: Any, depth: int = 0) -> Any:
    """An immutable copy of a plain value (None, bool, int, float, str, bytes, and lists, tuples and
    dicts of them) that compares equal exactly when the value would pickle the same; None for
    anything else (never reused). Types are part of it (``1``, ``1.0`` and ``True`` differ), and so
    are dicts' key order and -0.0 against 0.0 (a NaN may be pickled again: it equals only itself)."""
    if depth > 8:
        return None
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value, repr(value)) if kind is float else (kind, value)
    if kind in (list, tuple):
        parts = tuple(frozen_value(v, depth + 1) for v in value)
        return None if any(p is None for p in parts) else (kind, parts)
    if kind is dict:
        pairs = tuple((frozen_value(k, depth + 1), frozen_value(v, depth + 1)) for k, v in value.items())
        return None if any(k is None or v is None for k, v in pairs) else (kind, pairs)
    return None


def _tensor_signature(sh: ShardedTensor) -> tuple:
    """Everything plan_tensor_items and its checks read, except the data's values and address."""
    d = sh.data
    fr = sh.flattened_range
    data = None if d is None else (d.dtype, d.shape, d.is_cpu or d.device, d.layout)
    return (
        sh.key,
        sh.dtype,
        sh.local_shape,
        sh.global_shape,
        sh.global_offset,
        sh.axis_fragmentations,
        sh.replica_id,
        sh.prepend_axis_num,
        sh.allow_shape_mismatch,
        None if fr is None else (fr.start, fr.stop, fr.step),
        data,
    )


def _plain_dense(data: Any) -> bool:
    """Whether ``data`` is a ``torch.Tensor`` (no subclass) with values in dense memory."""
    return type(data) is torch.Tensor and data.device.type != "meta" and data.layout is torch.strided


def _check_tensor_data(sh: ShardedTensor, path: Any, rank: int) -> None:
    if _plain_dense(sh.data):
        # The common case, without building the error text (a save checks every item).
        try:
            sh.validate_metadata_integrity()
        except ShardingError as exc:
            raise ShardingError(f"{exc} (at {path_str(path)}, rank {rank})") from None
        return
    where = f"ShardedTensor '{sh.key}' at {path_str(path)} (rank {rank})"
    if sh.data is None:
        raise ShardingError(f"{where} has no data to save; pass the tensor as data")
    if not isinstance(sh.data, torch.Tensor):
        raise ShardingError(
            f"{where}: data is a {type(sh.data).__name__}, not a torch.Tensor; wrap non-tensor "
            "values in ShardedObject or leave them as common state"
        )
    if type(sh.data) is not torch.nn.Parameter and type(sh.data) is not torch.Tensor:
        raise ShardingError(
            f"{where}: data is a {type(sh.data).__module__}.{type(sh.data).__qualname__}, a tensor "
            "subclass whose bytes ckptd cannot take as the tensor's values; pass a plain tensor "
            "(e.g. dtensor.to_local(), or the subclass's dequantized values)"
        )
    if sh.data.device.type == "meta":
        raise ShardingError(f"{where}: data is a meta tensor (no values); materialize it first")
    if sh.data.layout is not torch.strided:
        raise ShardingError(
            f"{where}: data is a {sh.data.layout} tensor; ckptd stores dense (strided) tensors only, as "
            "torch_dist does: save tensor.to_dense(), or its indices and values as tensors of their own"
        )
    try:
        sh.validate_metadata_integrity()
    except ShardingError as exc:
        raise ShardingError(f"{exc} (at {path_str(path)}, rank {rank})") from None
