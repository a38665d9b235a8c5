"""Box arithmetic on N-D index spaces: intersections, flat ranges as boxes, contiguous runs.

A *box* is ``(offsets, sizes)`` in some coordinate system. Every array ckptd reads or writes is
row-major and contiguous, so a box inside it is a set of equally long contiguous *runs*.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

Shape = tuple[int, ...]


class Box(Protocol):
    """A box of a global tensor (a stored chunk, an item record, a read's source)."""

    @property
    def offsets(self) -> Shape: ...

    @property
    def sizes(self) -> Shape: ...


B = TypeVar("B", bound=Box)


def intersect(a_off: Shape, a_size: Shape, b_off: Shape, b_size: Shape) -> tuple[Shape, Shape] | None:
    """The intersection of two boxes, or None if it is empty."""
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi))


def strides(shape: Shape) -> Shape:
    """Row-major strides (in elements) of a contiguous array."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def flat_range_boxes(shape: Shape, start: int, stop: int) -> list[tuple[Shape, Shape, int]]:
    """Split the row-major flat range ``[start, stop)`` of ``shape`` into boxes.

    Returns ``(offsets, sizes, flat_start)`` triples in flat order; each box is contiguous in the
    flattening (a partial range on one axis, full extent on the axes after it), so box ``i``
    holds exactly the flat elements ``[flat_start_i, flat_start_i + numel_i)``. At most
    ``2 * ndim - 1`` boxes.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * len(rest)

    def rows(r0: int, c0: int, c1: int) -> list[tuple[Shape, Shape, int]]:
        return [((r0,) + o, (1,) + s, f + r0 * inner) for o, s, f in flat_range_boxes(rest, c0, c1)]

    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        return rows(r0, c0, c1)
    out: list[tuple[Shape, Shape, int]] = []
    if c0:
        out += rows(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + zeros, (r1 - r0,) + rest, r0 * inner))
    if c1:
        out += rows(r1, 0, c1)
    return out


@dataclass(frozen=True)
class Runs:
    """The contiguous runs of one box copy between two row-major arrays.

    ``count`` runs of ``length`` elements; run ``i`` starts at ``src_starts[i]`` in the source
    array and ``dst_starts[i]`` in the destination array (element offsets, ascending).
    """

    length: int
    src_starts: list[int]
    dst_starts: list[int]

    @property
    def count(self) -> int:
        return len(self.src_starts)


def split_axis(sizes: Shape, src_shape: Shape, dst_shape: Shape) -> int:
    """The axis ``m`` such that a copy of box ``sizes`` is contiguous in both arrays from ``m`` on.

    Axes after ``m`` span both arrays fully; axis ``m`` may be partial. A run is then
    ``prod(sizes[m:])`` elements long.
    """
    m = len(sizes) - 1
    while m > 0 and sizes[m] == src_shape[m] and sizes[m] == dst_shape[m]:
        m -= 1
    return max(m, 0)


def run_length(sizes: Shape, src_shape: Shape, dst_shape: Shape) -> int:
    if not sizes:
        return 1
    return math.prod(sizes[split_axis(sizes, src_shape, dst_shape) :])


def enumerate_runs(src_shape: Shape, src_off: Shape, dst_shape: Shape, dst_off: Shape, sizes: Shape) -> Runs:
    """All runs of copying box ``sizes`` from ``src_off`` in ``src_shape`` to ``dst_off`` in ``dst_shape``."""
    if not sizes:
        return Runs(1, [0], [0])
    m = split_axis(sizes, src_shape, dst_shape)
    length = math.prod(sizes[m:])
    ss, ds = strides(src_shape), strides(dst_shape)
    src0 = sum(o * s for o, s in zip(src_off, ss))
    dst0 = sum(o * s for o, s in zip(dst_off, ds))
    src_starts, dst_starts = [src0], [dst0]
    # Expand the outer axes (before m) one at a time, innermost last, keeping row-major order.
    for axis in range(m):
        n = sizes[axis]
        if n == 1:
            continue
        step_s, step_d = ss[axis], ds[axis]
        src_starts = [b + i * step_s for b in src_starts for i in range(n)]
        dst_starts = [b + i * step_d for b in dst_starts for i in range(n)]
    return Runs(length, src_starts, dst_starts)


def count_runs(sizes: Shape, src_shape: Shape, dst_shape: Shape) -> int:
    if not sizes:
        return 1
    return math.prod(sizes[: split_axis(sizes, src_shape, dst_shape)])


def boxes_overlap(a: Box, b: Box) -> bool:
    """Whether boxes ``a`` and ``b`` share an element."""
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def find_overlap(given: Sequence[B]) -> tuple[B, B] | None:
    """Two of ``given`` (boxes of one rank of dimensions) that share an element, or None
    (empty boxes share none, and 0-d ones are not compared).

    A sweep along the axis with the most distinct chunk starts (4,000 chunks of one row are swept
    along the row, not across it): the boxes still spanning the sweep position are kept ordered
    by their start on a second axis, and a new box is compared in full only with those starting
    within the widest box's extent before it on that axis. Grid-like layouts cost O(n log n);
    any N-D boxes are checked correctly (a pair overlapping on every axis is always compared).
    """
    boxes = [c for c in given if math.prod(c.sizes)]
    if len(boxes) < 2 or not boxes[0].offsets:
        return None
    ndim = len(boxes[0].offsets)
    axes = sorted(range(ndim), key=lambda ax: len({r.offsets[ax] for r in boxes}), reverse=True)
    a = axes[0]
    b = axes[1] if ndim > 1 else None
    width_b = max(r.sizes[b] for r in boxes) if b is not None else 0
    active: list[tuple[int, int, B]] = []  # (start on axis b, sequence, box), sorted
    ends: list[tuple[int, int, int]] = []  # heap of (end on axis a, start on axis b, sequence)
    for seq, box in enumerate(sorted(boxes, key=lambda r: r.offsets[a])):
        start = box.offsets[a]
        while ends and ends[0][0] <= start:  # no later box reaches back to these on axis a
            _, key, done = heapq.heappop(ends)
            del active[bisect.bisect_left(active, (key, done))]
        if b is None:
            candidates = active
        else:
            lo = bisect.bisect_left(active, (box.offsets[b] - width_b + 1,))
            hi = bisect.bisect_left(active, (box.offsets[b] + box.sizes[b],))
            candidates = active[lo:hi]
        for _, _, other in candidates:
            if boxes_overlap(other, box):
                return other, box
        key = box.offsets[b] if b is not None else 0
        bisect.insort(active, (key, seq, box))
        heapq.heappush(ends, (start + box.sizes[a], key, seq))
    return None
