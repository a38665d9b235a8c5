"""Planning a load: intersect each requested chunk with the stored chunks.

Every requested element is either read from exactly one stored chunk or, for
``allow_shape_mismatch`` tensors, lies outside the stored global shape and is zero-filled.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field

import torch

from ..errors import CorruptCheckpointError, LoadMismatchError
from ..format.dcp_metadata import CheckpointIndex, StoredChunk, StoredTensor
from ..format.records import storage_layout
from ..mapping import ShardedTensor

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass
class Copy:
    """Copy ``source[src]`` of a stored chunk into ``target[dst]``."""

    target: torch.Tensor
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


@dataclass
class ReadPlan:
    """Stored chunks to read (keyed by file location) and the copies each one feeds."""

    reads: dict[tuple[str, int], tuple[StoredChunk, str, list[Copy]]] = field(default_factory=dict)

    def add(self, chunk: StoredChunk, what: str, copy: Copy) -> None:
        key = (chunk.relative_path, chunk.file_offset)
        if key not in self.reads:
            self.reads[key] = (chunk, what, [])
        self.reads[key][2].append(copy)

    @property
    def nbytes(self) -> int:
        return sum(c.length for c, _, _ in self.reads.values())


def _intersect(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def missing_key_error(key: str, known: list[str], what: str = "tensor") -> LoadMismatchError:
    close = difflib.get_close_matches(key, known, n=3)
    hint = f" Did you mean {close}?" if close else f" The checkpoint has {len(known)} such keys."
    return LoadMismatchError(f"{what} '{key}' is not in the checkpoint.{hint}")


def check_compatible(sh: ShardedTensor, stored: StoredTensor) -> None:
    gshape, _, _ = storage_layout(sh)
    if stored.dtype != sh.dtype:
        raise LoadMismatchError(
            f"tensor '{sh.key}': the checkpoint stores {stored.dtype} but {sh.dtype} was "
            "requested; request the stored dtype and cast after loading"
        )
    if len(gshape) != len(stored.shape) or (gshape != stored.shape and not sh.allow_shape_mismatch):
        raise LoadMismatchError(
            f"tensor '{sh.key}': the checkpoint stores global shape {stored.shape} but "
            f"{gshape} was requested; fix the model config or set allow_shape_mismatch=True to "
            "pad/truncate"
        )


def plan_tensor(plan: ReadPlan, sh: ShardedTensor, target: torch.Tensor, index: CheckpointIndex) -> None:
    """Add the reads that fill ``target`` (a tensor shaped like the stored chunk box of ``sh``)."""
    stored = index.tensors.get(sh.key)
    if stored is None:
        raise missing_key_error(sh.key, sorted(index.tensors))
    check_compatible(sh, stored)
    _, offsets, sizes = storage_layout(sh)
    want: Box = (offsets, sizes)
    inside = _intersect(want, ((0,) * len(sizes), stored.shape))
    needed = math.prod(inside[1]) if inside else 0
    if needed < math.prod(sizes):
        target.zero_()  # the part outside the stored shape (allow_shape_mismatch) is padding
    covered = 0
    for chunk in stored.chunks:
        box = _intersect(want, (chunk.offsets, chunk.sizes))
        if box is None:
            continue
        covered += math.prod(box[1])
        src = tuple(slice(l - c, l - c + s) for l, s, c in zip(box[0], box[1], chunk.offsets))
        dst = tuple(slice(l - o, l - o + s) for l, s, o in zip(box[0], box[1], offsets))
        plan.add(chunk, f"tensor '{sh.key}' chunk {chunk.offsets}", Copy(target, src, dst))
    if covered != needed:
        raise CorruptCheckpointError(
            f"tensor '{sh.key}': the stored chunks cover {covered} of the {needed} requested "
            f"elements at offsets {offsets} sizes {sizes} (overlapping or missing chunks); the "
            "checkpoint metadata is inconsistent"
        )
