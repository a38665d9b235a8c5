"""Planning a load: requested boxes intersected with the checkpoint's sources, grouped by item.

Each requested ShardedTensor becomes one or more *targets*: contiguous destination tensors with
a box in global coordinates (one for an N-D shard; up to ``2 * ndim - 1`` for a flattened shard,
one per contiguous piece of its flat range). Every requested element is either read from exactly
one source or, for ``allow_shape_mismatch`` tensors, lies outside the stored global shape and is
zero-filled (Megatron-Core's padding / truncation semantics).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

import torch

from ..errors import CorruptCheckpointError, LoadMismatchError
from ..format.geometry import Shape, flat_range_boxes, intersect
from ..mapping import ShardedTensor
from .view import CheckpointView, ItemRef, VirtualTensor, is_legacy_grid, translate_legacy_grid


@dataclass(frozen=True)
class Target:
    """A contiguous CPU destination ``tensor`` for the global box ``(offsets, sizes)``."""

    tensor: torch.Tensor
    offsets: Shape
    sizes: Shape


@dataclass(frozen=True)
class CopyOp:
    """Copy box ``sizes`` at ``src_origin`` of a source array into ``dst`` at ``dst_offsets``."""

    array_shape: Shape
    elem_offset: int
    src_origin: Shape
    sizes: Shape
    dst: torch.Tensor
    dst_offsets: Shape


@dataclass
class ItemReads:
    item: ItemRef
    dtype: torch.dtype
    what: str
    copies: list[CopyOp] = field(default_factory=list)


@dataclass
class ReadPlan:
    """Stored items to read (keyed by file location) and the copies each one feeds."""

    items: dict[tuple[str, int], ItemReads] = field(default_factory=dict)

    def add(self, item: ItemRef, dtype: torch.dtype, what: str, op: CopyOp) -> None:
        entry = self.items.get(item.key)
        if entry is None:
            entry = self.items[item.key] = ItemReads(item, dtype, what)
        elif entry.item != item or entry.dtype != dtype:
            # Another stored item at the same place (a flipped bit in a file name or an offset):
            # read once, as the first, whose checksum passed, it gave the second the first's values.
            raise CorruptCheckpointError(
                f"{entry.what} (chunk at {entry.item.offsets}) and {what} (chunk at {item.offsets}) are stored at "
                f"the same place, byte {item.file_offset} of "
                f"{item.relative_path!r:.200}: the checkpoint's .metadata is damaged; load an earlier checkpoint "
                "(`ckptd verify` checks the whole checkpoint)"
            )
        entry.copies.append(op)

    @property
    def nbytes(self) -> int:
        """Bytes the plan copies into destinations."""
        return sum(math.prod(op.sizes) * op.dst.element_size() for e in self.items.values() for op in e.copies)


def missing_key_error(
    key: str, known: list[str], what: str = "tensor", stored_as: str | None = None
) -> LoadMismatchError:
    """``stored_as``: what the checkpoint holds under ``key`` instead ("a value", "a tensor")."""
    if stored_as is not None:
        return LoadMismatchError(
            f"{what} '{key}' was requested, but the checkpoint stores {stored_as} under that key; "
            f"request {stored_as} there (as it was saved), or map another key to it with key_mapping=[...]"
        )
    close = difflib.get_close_matches(key, known, n=3)
    hint = f" Did you mean {close}?" if close else f" The checkpoint has {len(known)} such keys."
    return LoadMismatchError(
        f"{what} '{key}' is not in the checkpoint.{hint} Map it with key_mapping=[...], or pass "
        "strict='log_all' (or another non-raising mode) to skip it."
    )


def targets_for(sh: ShardedTensor, data: torch.Tensor) -> list[Target]:
    """Destination boxes of a request; ``data`` is its contiguous CPU buffer (flat or chunk-shaped)."""
    chunk = sh.chunk_shape()
    if sh.flattened_range is None:
        return [Target(data.view(chunk), sh.global_offset, chunk)]
    start = sh.flattened_range.start
    out = []
    for off, sizes, flat in flat_range_boxes(chunk, start, sh.flattened_range.stop):
        n = math.prod(sizes)
        out.append(
            Target(
                data[flat - start : flat - start + n].view(sizes),
                tuple(g + o for g, o in zip(sh.global_offset, off)),
                sizes,
            )
        )
    return out


class Planner:
    """Builds a ReadPlan from requests against one CheckpointView (the caller runs it).

    ``allow_cast``: a request in another dtype than stored resolves (the caller reads it into a
    buffer of the stored dtype and casts); else it raises. ``dcp_style``: requests come from a
    DCP-style state dict (plain tensors, DTensors), which cannot set ``allow_shape_mismatch``, so
    errors suggest what such a request can do instead.
    """

    def __init__(self, view: CheckpointView, *, allow_cast: bool = False, dcp_style: bool = False) -> None:
        self.view = view
        self.plan = ReadPlan()
        self.allow_cast = allow_cast
        self.dcp_style = dcp_style
        self._translated: dict[tuple[str, Shape], VirtualTensor] = {}

    def resolve(self, sh: ShardedTensor) -> VirtualTensor:
        stored = self.view.tensors.get(sh.key)
        if stored is None:
            raise missing_key_error(sh.key, sorted(self.view.tensors))
        if stored.dtype != sh.dtype and not self.allow_cast:
            raise LoadMismatchError(
                f"tensor '{sh.key}': the checkpoint stores {stored.dtype} but {sh.dtype} was "
                "requested; request the stored dtype, or pass allow_dtype_cast=True to cast as "
                "dcp.load does"
            )
        gshape = sh.global_shape
        # Only a tensor the checkpoint records as stored in the grid layout at this shape: a regular
        # tensor requested at another shape that happens to fit the pattern would load permuted.
        if stored.shape != gshape and self.view.grid_shapes.get(sh.key) == gshape and is_legacy_grid(stored, gshape):
            cache_key = (sh.key, gshape)
            if cache_key not in self._translated:
                self._translated[cache_key] = translate_legacy_grid(stored, gshape)
            stored = self._translated[cache_key]
        if len(gshape) != len(stored.shape) or (gshape != stored.shape and not sh.allow_shape_mismatch):
            where = f" ({stored.origin})" if stored.origin else ""
            if self.dcp_style:
                fix = (
                    "fix the model config; to pad or truncate, load that key alone as a "
                    f"ckptd.ShardedTensor with allow_shape_mismatch=True (the stored shape is {stored.shape}, "
                    "e.g. from ckptd.load_tensors_metadata) or with ckptd.load_plain_tensors, and copy what "
                    "fits into your tensor: plain tensors and DTensors cannot say allow_shape_mismatch"
                )
            else:
                fix = (
                    "fix the model config, or set allow_shape_mismatch=True to zero-pad / truncate "
                    "along the differing axes"
                )
            raise LoadMismatchError(
                f"tensor '{sh.key}': the checkpoint stores global shape {stored.shape}{where} but "
                f"{gshape} was requested; {fix}"
            )
        return stored

    def add(self, sh: ShardedTensor, data: torch.Tensor) -> None:
        """Plan the reads that fill ``data`` (contiguous CPU, flat or chunk-shaped) for ``sh``."""
        stored = self.resolve(sh)
        for t in targets_for(sh, data):
            self._add_target(sh, stored, t)

    def _add_target(self, sh: ShardedTensor, stored: VirtualTensor, t: Target) -> None:
        inside = intersect(t.offsets, t.sizes, (0,) * len(t.sizes), stored.shape)
        needed = math.prod(inside[1]) if inside else 0
        if needed < math.prod(t.sizes):
            t.tensor.zero_()  # outside the stored shape: padding (allow_shape_mismatch)
        covered = 0
        what = f"tensor '{sh.key}'"
        for src, off, sizes in stored.overlapping(t.offsets, t.sizes):
            covered += math.prod(sizes)
            self.plan.add(
                src.item,
                stored.dtype,
                what,
                CopyOp(
                    array_shape=src.array_shape,
                    elem_offset=src.elem_offset,
                    src_origin=tuple(o + a - b for o, a, b in zip(src.origin, off, src.offsets)),
                    sizes=sizes,
                    dst=t.tensor,
                    dst_offsets=tuple(a - b for a, b in zip(off, t.offsets)),
                ),
            )
        if covered != needed:
            raise CorruptCheckpointError(
                f"tensor '{sh.key}'{f' ({stored.origin})' if stored.origin else ''}: the stored "
                f"chunks cover {covered} of the {needed} requested elements at offsets "
                f"{t.offsets} sizes {t.sizes} (overlapping or missing chunks); the checkpoint "
                "metadata is inconsistent"
            )
