"""The loader's view of a checkpoint: tensors as sets of *sources* in global coordinates.

A stored chunk is one source. Key mapping (fuse/split/rename) and the legacy flattened grid
layout turn stored chunks into sources that cover only part of a stored item, or that sit at
other global offsets; the read planner only ever sees sources, so every layout change composes
with resharding.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

import torch

from ..errors import CorruptCheckpointError
from ..format.dcp_metadata import CheckpointIndex, StoredChunk, StoredObject
from ..format.geometry import Shape, find_overlap, flat_range_boxes, intersect
from ..format.objectkey import completed_object_keys


@dataclass(frozen=True)
class ItemRef:
    """One stored tensor item: where its bytes are and the row-major shape it holds."""

    relative_path: str
    file_offset: int
    length: int
    shape: Shape  # the chunk's sizes as stored (the torch.save'd tensor's shape)
    offsets: Shape = ()  # the stored chunk's global offsets (for messages)
    crc: int | None = None  # the item's checksum recorded at save time, if any
    # Its blocks' checksums (packed, ckptd.format.checksum), and the checkpoint's block size (0: the
    # checkpoint records no block checksums, and a part of the item is checked only by reading all).
    block_crcs: bytes = b""
    block_nbytes: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return (self.relative_path, self.file_offset)


@dataclass(frozen=True)
class Source:
    """A box of a (virtual) global tensor whose values live in one stored item.

    The values are the sub-box at ``origin`` (size ``sizes``) of a row-major array of shape
    ``array_shape`` that starts ``elem_offset`` elements into the item's data.
    """

    offsets: Shape
    sizes: Shape
    item: ItemRef
    array_shape: Shape
    origin: Shape
    elem_offset: int = 0

    @classmethod
    def of_chunk(cls, chunk: StoredChunk, block_nbytes: int = 0) -> Source:
        ref = ItemRef(
            chunk.relative_path,
            chunk.file_offset,
            chunk.length,
            tuple(chunk.sizes),
            tuple(chunk.offsets),
            chunk.crc,
            chunk.block_crcs,
            block_nbytes,
        )
        return cls(tuple(chunk.offsets), tuple(chunk.sizes), ref, tuple(chunk.sizes), (0,) * len(chunk.sizes))

    def restrict(self, axis: int, lo: int, hi: int) -> Source | None:
        """The part of this source with ``lo <= index < hi`` on ``axis`` (None if empty)."""
        a, b = max(lo, self.offsets[axis]), min(hi, self.offsets[axis] + self.sizes[axis])
        if a >= b:
            return None
        shift = a - self.offsets[axis]
        return replace(
            self,
            offsets=_set(self.offsets, axis, a),
            sizes=_set(self.sizes, axis, b - a),
            origin=_set(self.origin, axis, self.origin[axis] + shift),
        )

    def shifted(self, axis: int, delta: int) -> Source:
        return replace(self, offsets=_set(self.offsets, axis, self.offsets[axis] + delta))


def _set(t: Shape, axis: int, value: int) -> Shape:
    return t[:axis] + (value,) + t[axis + 1 :]


@dataclass
class VirtualTensor:
    """A tensor as the loader sees it: dtype, global shape and the sources that cover it."""

    key: str
    dtype: torch.dtype
    shape: Shape
    sources: list[Source]
    origin: str = ""  # how it was derived (for error messages), empty for stored tensors
    _starts: list[int] | None = field(default=None, repr=False)
    _max_extent: int = field(default=0, repr=False)

    def candidates(self, offsets: Shape, sizes: Shape) -> list[Source]:
        """Sources that may intersect the box (filtered on axis 0, exact check by the caller)."""
        if not self.shape or len(self.sources) <= 8:
            return self.sources
        if self._starts is None:
            self.sources.sort(key=lambda s: s.offsets[0])
            self._starts = [s.offsets[0] for s in self.sources]
            self._max_extent = max((s.sizes[0] for s in self.sources), default=0)
        lo = bisect.bisect_left(self._starts, offsets[0] - self._max_extent + 1)
        hi = bisect.bisect_left(self._starts, offsets[0] + sizes[0])
        return self.sources[lo:hi]

    def overlapping(self, offsets: Shape, sizes: Shape) -> list[tuple[Source, Shape, Shape]]:
        out = []
        for s in self.candidates(offsets, sizes):
            box = intersect(offsets, sizes, s.offsets, s.sizes)
            if box is not None:
                out.append((s, box[0], box[1]))
        return out


@dataclass
class CheckpointView:
    """All tensors and objects a load can request, after key mapping. ``grid_shapes``: the global
    shape of each tensor stored in Megatron-Core's flattened grid layout, as its ``.metadata``
    records it (:func:`grid_shapes`)."""

    tensors: dict[str, VirtualTensor]
    objects: dict[str, StoredObject]
    grid_shapes: dict[str, Shape] = field(default_factory=dict)

    @classmethod
    def of_index(cls, index: CheckpointIndex) -> CheckpointView:
        """The view of ``index``; CorruptCheckpointError when two stored chunks of a tensor overlap
        (a load counts the elements each request gets, which an overlap next to an equally large
        gap would pass, leaving the gap's elements unread)."""
        tensors = {}
        for fqn, t in index.tensors.items():
            sources = [Source.of_chunk(c, index.block_nbytes) for c in t.chunks]
            found = find_overlap(sources, f"tensor '{fqn}'")
            if found is not None:
                a, b = found
                raise CorruptCheckpointError(
                    f"tensor '{fqn}': its stored chunks at offsets {a.offsets} (sizes {a.sizes}) and "
                    f"{b.offsets} (sizes {b.sizes}) overlap: the checkpoint's .metadata is damaged or was "
                    "written wrong (each element is stored once); `ckptd verify` checks the whole checkpoint"
                )
            tensors[fqn] = VirtualTensor(fqn, t.dtype, tuple(t.shape), sources)
        return cls(tensors, completed_objects(index), grid_shapes(index))


def completed_objects(index: CheckpointIndex) -> dict[str, StoredObject]:
    """The checkpoint's objects by the key a load asks for: a ShardedObject shard an older
    Megatron-Core stored under a key lacking its shape's last dimension under its whole key
    (:func:`ckptd.format.objectkey.completed_object_keys`)."""
    completed = completed_object_keys(k for k, o in index.objects.items() if o.sharded_object)
    return {completed.get(k, k): o for k, o in index.objects.items()}


def grid_shapes(index: CheckpointIndex) -> dict[str, Shape]:
    """``{key: global shape}`` of the tensors Megatron-Core (0.8 to 0.13) stored in its flattened
    grid layout (:func:`is_legacy_grid`): it records each one's real global shape in the extra
    ``mcore_data`` attribute of ``.metadata`` (``nd_reformulated_orig_global_shape``), which is
    what tells such a tensor from a regular one whose shape merely fits the grid pattern. Entries
    that are not a shape are ignored (the tensor then loads at its stored shape only)."""
    data = getattr(index.raw, "mcore_data", None)
    out: dict[str, Shape] = {}
    if not isinstance(data, dict):
        return out
    for key, entry in data.items():
        shape = entry.get("nd_reformulated_orig_global_shape") if isinstance(entry, dict) else None
        if isinstance(key, str) and isinstance(shape, (tuple, list)) and all(type(n) is int for n in shape):
            out[key] = tuple(shape)
    return out


def is_legacy_grid(stored: VirtualTensor, global_shape: Shape) -> bool:
    """Whether ``stored`` has the shape and chunks of a flattened tensor of ``global_shape`` in
    Megatron-Core's pre-0.14 grid layout (the checkpoint must also say it is one: :func:`grid_shapes`).

    That layout stores a tensor of global shape ``G`` sharded on a grid of ``F`` chunks as a
    tensor of shape ``F + (prod(G / F),)`` whose chunks are 1-D slices of flattened grid cells.
    """
    s = stored.shape
    if len(s) != len(global_shape) + 1 or math.prod(s) != math.prod(global_shape) or stored.origin:
        return False
    if any(f <= 0 or g % f for g, f in zip(global_shape, s[:-1])):
        return False
    cell = tuple(g // f for g, f in zip(global_shape, s[:-1]))
    return math.prod(cell) == s[-1] and all(all(x == 1 for x in src.sizes[:-1]) for src in stored.sources)


def translate_legacy_grid(stored: VirtualTensor, global_shape: Shape) -> VirtualTensor:
    """Re-express a legacy grid-layout tensor as N-D sources of ``global_shape``."""
    grid = stored.shape[:-1]
    cell = tuple(g // f for g, f in zip(global_shape, grid))
    sources: list[Source] = []
    for src in stored.sources:
        if src.origin != (0,) * len(src.origin) or src.elem_offset:
            raise CorruptCheckpointError(f"tensor '{stored.key}': unexpected nested grid source")
        cell_idx = src.offsets[:-1]
        start = src.offsets[-1]
        base = tuple(c * s for c, s in zip(cell_idx, cell))
        for off, sizes, flat in flat_range_boxes(cell, start, start + src.sizes[-1]):
            sources.append(
                Source(
                    offsets=tuple(b + o for b, o in zip(base, off)),
                    sizes=sizes,
                    item=src.item,
                    array_shape=sizes,
                    origin=(0,) * len(sizes),
                    elem_offset=flat - start,
                )
            )
    return VirtualTensor(
        stored.key, stored.dtype, tuple(global_shape), sources, origin=f"legacy flattened grid layout {stored.shape}"
    )
