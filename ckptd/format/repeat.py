"""Repeated saves of one structure: a DCP-style state dict planned once, its tensors swapped in.

A training job saves a state dict of the same structure at every save: the same keys, each tensor
of the same dtype, shape and device, mostly the same plain values. Taking it apart and planning it
(:mod:`ckptd.statedict.split`, :mod:`ckptd.format.saveplan`) costs ~10 us per tensor, some 10 ms
of every ``save()``'s stall for a model of a thousand tensors. A :class:`RepeatPlan` remembers the
last full plan of a DCP-style state dict whose leaves are plain tensors (``torch.Tensor`` itself)
and plain Python values, and plans a save that walks to exactly that structure by putting its
tensors into the remembered records' places: ~1 us per leaf. The walk compares every dict's keys
(and their types), every walked list's length, every leaf's type, and then every tensor's dtype,
shape, device and layout; a plain value that changed is serialized again, as the full plan does.
Anything else (a Megatron-style state dict, a DTensor, a tensor subclass, a value other than a
plain Python value, any difference) takes the full way, which remembers its plan anew.

Order of use, per save: :meth:`RepeatPlan.plan`; if None, the full plan, then
:meth:`RepeatPlan.remember` with the :class:`PlannedSave` it made (or :meth:`RepeatPlan.forget`
when it failed). The plan is the one the
full way makes, item for item (tests/unit/test_repeat_plan.py compares them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from ..mapping import ByteItem, ShardedTensor
from ..statedict.split import Dialect, SplitStateDict, dcp_walk
from .items import PlannedItem, plan_bytes
from .records import ItemRecord
from .saveplan import RankPlan, frozen_value


@dataclass(frozen=True, kw_only=True)
class PlannedSave:
    """What one rank's save stores: as :class:`~ckptd.format.saveplan.RankPlan` (``items``,
    ``held``), the items' ``placements`` in the ring and the ``nbytes`` they take, and what the
    plan derived from the state dict's structure: the plain-key digest (``plain``), the plain keys
    left to other ranks (``skip``), rank 0's ``common`` bytes and their ``common_digest``."""

    items: list[PlannedItem]
    placements: list[Any]
    nbytes: int
    held: list[str]
    plain: str
    skip: frozenset[str]
    common: bytes | None
    common_digest: str


class _Tensor(NamedTuple):  # one per tensor of the state dict: cheaper to make than a dataclass
    leaf: int  # index in the walk
    signature: tuple  # dtype, shape, device, layout
    record: ItemRecord | None  # None: not stored by this rank (another rank writes it)


@dataclass(frozen=True, kw_only=True)
class _Value:
    leaf: int
    key: str
    path: tuple[str | int, ...]  # as DCP's planner_data records it
    frozen: Any  # saveplan.frozen_value of the value planned
    item: PlannedItem


@dataclass(frozen=True, kw_only=True)
class _Template:
    shape: list[Any]  # dcp_walk's structure
    tensors: list[_Tensor]  # every tensor leaf
    stored: list[_Tensor | _Value]  # what makes each item, in item order
    held_values: list[int]  # leaves of the plain values another rank writes
    saved: PlannedSave  # the full plan remembered, without its items


# Lays items out in the ring: ckptd.staging.rankside.place (staging sits above this layer).
Placer = Callable[[list[PlannedItem]], tuple[list[Any], int]]


def _signature(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.device, t.layout)


class RepeatPlan:
    """The last full plan of a Checkpointer's saves, reusable by the next save of its structure."""

    def __init__(self) -> None:
        self._template: _Template | None = None

    def forget(self) -> None:
        self._template = None

    def plan(self, state_dict: dict[str, Any], rank: int, place: Placer) -> PlannedSave | None:
        """The remembered plan with ``state_dict``'s tensors and values, if its structure is the
        remembered one; else None (plan it the full way). ``place`` lays the items out again
        where a plain value's bytes changed size."""
        t = self._template
        if t is None or not isinstance(state_dict, dict):
            return None
        leaves, shape = dcp_walk(state_dict)
        if shape != t.shape:
            return None
        for tensor in t.tensors:
            if _signature(leaves[tensor.leaf]) != tensor.signature:
                return None
        for i in t.held_values:  # a list or tuple may now hold what the full way refuses or shards
            if frozen_value(leaves[i]) is None:
                return None
        items: list[PlannedItem] = []
        resized = False
        for e in t.stored:
            if isinstance(e, _Tensor):
                items.append(PlannedItem(e.record, leaves[e.leaf]))  # type: ignore[arg-type]
                continue
            frozen = frozen_value(leaves[e.leaf])
            if frozen is None:  # a plain value's type is in the shape; this is one nested too deep
                return None
            item = e.item
            if frozen != e.frozen:
                item = plan_bytes(ByteItem(e.key, leaves[e.leaf]), rank, e.path)
                resized = resized or len(item.payload) != len(e.item.payload)
            items.append(item)
        saved = t.saved
        placements, nbytes = place(items) if resized else (saved.placements, saved.nbytes)
        return replace(saved, items=items, placements=placements, nbytes=nbytes)

    def remember(self, state_dict: dict[str, Any], split: SplitStateDict, plan: RankPlan, saved: PlannedSave) -> None:
        """Remember the full plan of ``state_dict`` (``split``, ``plan``; what the save stores,
        ``saved``) for the next save, where its structure allows."""
        found = _entries(state_dict, split, plan, saved.skip)
        if found is None:
            self._template = None
            return
        shape, tensors, stored, held_values = found
        # Without its items: their payloads are this save's tensors, which must not outlive it.
        self._template = _Template(
            shape=shape, tensors=tensors, stored=stored, held_values=held_values, saved=replace(saved, items=[])
        )


# Dict keys whose equal values have equal DCP keys (``str(k)``); 0.0 == -0.0 and (1, 2) == (1.0, 2)
# print differently, so a state dict with other keys is planned the full way at every save.
_EXACT_KEYS = (str, int, bool, type(None))


def _entries(
    state_dict: dict[str, Any], split: SplitStateDict, plan: RankPlan, skip: frozenset[str]
) -> tuple[list[Any], list[_Tensor], list[_Tensor | _Value], list[int]] | None:
    """The walk's structure, its tensor leaves, what makes each item and the leaves of the plain
    values left to other ranks, or None where the plan is not one :meth:`RepeatPlan.plan`
    reproduces exactly: only keys of :data:`_EXACT_KEYS`; each leaf of the walk the data of the
    split's entry at its position; each item made by one entry in order (a whole tensor's data
    itself, or a plain value's bytes)."""
    if split.dialect is not Dialect.DCP or split.factories or split.common:
        return None
    leaves, shape = dcp_walk(state_dict)
    if len(leaves) != len(split.sharded):
        return None
    if any(type(e) is tuple and not all(k in _EXACT_KEYS for k in e[1]) for e in shape):
        return None
    tensors: list[_Tensor] = []
    stored: list[_Tensor | _Value] = []
    held_values: list[int] = []
    items = iter(plan.items)
    entry: _Tensor | _Value
    for i, (sh, leaf) in enumerate(zip(split.sharded.values(), leaves)):
        if sh.data is not leaf:
            return None
        item = None if sh.key in skip else next(items, None)
        if isinstance(sh, ShardedTensor):
            if type(leaf) is not torch.Tensor or (item is not None and item.payload is not leaf):
                return None
            entry = _Tensor(i, _signature(leaf), None if item is None else item.record)
            tensors.append(entry)
        elif isinstance(sh, ByteItem):
            frozen = frozen_value(leaf)
            if frozen is None:
                return None
            if item is None:
                held_values.append(i)
                continue
            entry = _Value(leaf=i, key=sh.key, path=split.dcp_paths.get(sh.key, ()), frozen=frozen, item=item)
        else:
            return None
        if item is not None:
            if item.record.fqn != sh.key:
                return None
            stored.append(entry)
    if next(items, None) is not None:
        return None
    return shape, tensors, stored, held_values
