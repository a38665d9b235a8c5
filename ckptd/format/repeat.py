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
:meth:`RepeatPlan.remember` (or :meth:`RepeatPlan.forget` when it failed). The plan is the one the
full way makes, item for item (tests/unit/test_repeat_plan.py compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..mapping import ByteItem, ShardedTensor
from ..statedict.split import Dialect, SplitStateDict, dcp_walk
from .items import PlannedItem, plan_bytes
from .records import ItemRecord
from .saveplan import RankPlan, frozen_value


@dataclass(frozen=True, kw_only=True)
class RepeatedSave:
    """What a save of a remembered structure stores: as :class:`~ckptd.format.saveplan.RankPlan`
    (``items``, ``held``), the items' ``placements`` and ``nbytes`` as ``place`` computed them
    (``placements`` None: a value's bytes changed size, place the items again), and what the full
    plan derived from the structure alone: the plain-key ``digest``, the plain keys left to other
    ranks (``skip``), rank 0's ``common`` bytes and their ``common_digest``."""

    items: list[PlannedItem]
    held: list[str]
    placements: list[Any] | None
    nbytes: int
    digest: str
    skip: frozenset[str]
    common: bytes | None
    common_digest: str


@dataclass(frozen=True, kw_only=True)
class _Tensor:
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
    held: list[str]
    placements: list[Any]
    nbytes: int
    digest: str
    skip: frozenset[str]
    common: bytes | None
    common_digest: str


def _signature(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.device, t.layout)


class RepeatPlan:
    """The last full plan of a Checkpointer's saves, reusable by the next save of its structure."""

    def __init__(self) -> None:
        self._template: _Template | None = None

    def forget(self) -> None:
        self._template = None

    def plan(self, state_dict: dict[str, Any], rank: int) -> RepeatedSave | None:
        """The remembered plan with ``state_dict``'s tensors and values, if its structure is the
        remembered one; else None (plan it the full way)."""
        t = self._template
        if t is None:
            return None
        leaves, shape = dcp_walk(state_dict)
        if shape != t.shape:
            return None
        for tensor in t.tensors:
            if _signature(leaves[tensor.leaf]) != tensor.signature:
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
        return RepeatedSave(
            items=items,
            held=t.held,
            placements=None if resized else t.placements,
            nbytes=t.nbytes,
            digest=t.digest,
            skip=t.skip,
            common=t.common,
            common_digest=t.common_digest,
        )

    def remember(
        self,
        state_dict: dict[str, Any],
        split: SplitStateDict,
        plan: RankPlan,
        *,
        skip: frozenset[str],
        placements: list[Any],
        nbytes: int,
        digest: str,
        common: bytes | None,
        common_digest: str,
    ) -> None:
        """Remember the full plan of ``state_dict`` (``split``, ``plan`` made with ``skip``; the
        rest as the save computed it) for the next save, where its structure allows."""
        self._template = _template(
            state_dict,
            split,
            plan,
            skip=skip,
            placements=placements,
            nbytes=nbytes,
            digest=digest,
            common=common,
            common_digest=common_digest,
        )


def _template(
    state_dict: dict[str, Any],
    split: SplitStateDict,
    plan: RankPlan,
    *,
    skip: frozenset[str],
    placements: list[Any],
    nbytes: int,
    digest: str,
    common: bytes | None,
    common_digest: str,
) -> _Template | None:
    """The template of a full plan, or None where its structure is not one :meth:`RepeatPlan.plan`
    reproduces exactly: each leaf of the walk must be the data of the split's entry at its
    position, each item made by one entry in order (a whole tensor's data itself, or a plain
    value's bytes)."""
    if split.dialect is not Dialect.DCP or split.factories or split.common:
        return None
    leaves, shape = dcp_walk(state_dict)
    if len(leaves) != len(split.sharded):
        return None
    tensors: list[_Tensor] = []
    stored: list[_Tensor | _Value] = []
    items = iter(plan.items)
    entry: _Tensor | _Value
    for i, (sh, leaf) in enumerate(zip(split.sharded.values(), leaves)):
        if sh.data is not leaf:
            return None
        item = None if sh.key in skip else next(items, None)
        if isinstance(sh, ShardedTensor):
            if type(leaf) is not torch.Tensor or (item is not None and item.payload is not leaf):
                return None
            entry = _Tensor(leaf=i, signature=_signature(leaf), record=None if item is None else item.record)
            tensors.append(entry)
        elif isinstance(sh, ByteItem):
            frozen = frozen_value(leaf)
            if frozen is None:
                return None
            if item is None:
                continue
            path = split.dcp_paths.get(sh.key, ())
            entry = _Value(leaf=i, key=sh.key, path=path, frozen=frozen, item=item)
        else:
            return None
        if item is not None:
            if item.record.fqn != sh.key:
                return None
            stored.append(entry)
    if next(items, None) is not None:
        return None
    return _Template(
        shape=shape,
        tensors=tensors,
        stored=stored,
        held=list(plan.held),
        placements=list(placements),
        nbytes=nbytes,
        digest=digest,
        skip=skip,
        common=common,
        common_digest=common_digest,
    )
