"""Box arithmetic on N-D index spaces: intersections, flat ranges as boxes, contiguous runs.

A *box* is ``(offsets, sizes)`` in some coordinate system. Every array ckptd reads or writes is
row-major and contiguous, so a box inside it is a set of equally long contiguous *runs*.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from ..errors import CorruptCheckpointError

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


class OverlapCheckRefused(CorruptCheckpointError):
    """The chunks of one tensor are laid out so irregularly that checking them for overlaps
    would take longer than any real sharding layout comes near (see :class:`OverlapSearch`)."""

    def __init__(self, message: str, count: int, budget: int) -> None:
        super().__init__(message)
        self.count = count  # chunks of the tensor
        self.budget = budget  # steps the check was allowed


def find_overlap(given: Sequence[B], what: str = "a tensor in .metadata") -> tuple[B, B] | None:
    """Two of ``given`` (boxes of one rank of dimensions) that share an element, or None
    (empty boxes share none, and 0-d ones are not compared). The pair is in ``given``'s order.

    Exact, and bounded on any input, as ``.metadata`` is untrusted: a check that compared pairs
    let 100,000 crafted chunks (10 MB) take half an hour. Grids, flattened ranges and any layout
    that varies on at most two axes cost O(n log n) (see :class:`OverlapSearch`). A layout that
    needs more than ``OverlapSearch.budget`` steps (only crafted ones do: they vary on three or
    more axes at once, and not as a grid) raises :class:`OverlapCheckRefused` naming ``what``.
    """
    boxes = [c for c in given if math.prod(c.sizes)]
    if len(boxes) < 2 or not boxes[0].offsets:
        return None
    search = OverlapSearch(boxes)
    try:
        found = search.find()
    except _OverBudget:
        raise OverlapCheckRefused(
            f"{what}: its {len(boxes)} chunks (the first at offsets {tuple(boxes[0].offsets)}, sizes "
            f"{tuple(boxes[0].sizes)}) vary on several axes at once, and not as a grid, so checking "
            f"that no two overlap would take more than {search.budget} steps (real sharding layouts "
            "take a few per chunk); the check was stopped. The chunk index is damaged or was "
            "crafted: load an earlier checkpoint (`ckptd verify` names the tensor).",
            len(boxes),
            search.budget,
        ) from None
    if found is None:
        return None
    i, j = sorted(found)
    return boxes[i], boxes[j]


class _OverBudget(Exception):
    pass


_BRUTE_FORCE = 8  # sets this small are compared pairwise: cheaper than any structure


class _MaxTree:
    """Slots ``0..n-1`` holding values (``floor`` when empty): raise a slot's value, empty a
    slot, and find the slot holding the largest value among the first ``p``, each in O(log n)."""

    def __init__(self, n: int, floor: int) -> None:
        self.size = 1 << max(n - 1, 0).bit_length()
        self.floor = floor
        self.t = [floor] * (2 * self.size)

    def put(self, slot: int, value: int) -> None:
        """Set an empty slot (or one holding less) to ``value``."""
        t = self.t
        i = slot + self.size
        t[i] = value
        i >>= 1
        while i and t[i] < value:
            t[i] = value
            i >>= 1

    def clear(self, slot: int) -> None:
        t = self.t
        i = slot + self.size
        t[i] = self.floor
        while i > 1:
            i >>= 1
            m = t[2 * i] if t[2 * i] >= t[2 * i + 1] else t[2 * i + 1]
            if t[i] == m:
                break  # unchanged here, so unchanged above
            t[i] = m

    def best(self, p: int) -> int:
        """The slot with the largest value among slots ``[0, p)``, or -1 if all are empty."""
        t = self.t
        lo, hi = self.size, self.size + p
        node, value = 0, self.floor
        while lo < hi:
            if lo & 1:
                if t[lo] > value:
                    node, value = lo, t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > value:
                    node, value = hi, t[hi]
            lo >>= 1
            hi >>= 1
        if not node:
            return -1
        while node < self.size:  # down to a leaf holding that value
            node = 2 * node if t[2 * node] == value else 2 * node + 1
        return node - self.size


def _canonical(lo: int, hi: int, size: int) -> list[int]:
    """The nodes of a segment tree over ``size`` leaves that partition leaves ``[lo, hi)``
    (at most two per level), as in any bottom-up segment tree."""
    out = []
    lo += size
    hi += size
    while lo < hi:
        if lo & 1:
            out.append(lo)
            lo += 1
        if hi & 1:
            hi -= 1
            out.append(hi)
        lo >>= 1
        hi >>= 1
    return out


class OverlapSearch:
    """Finds two boxes that share an element: exact, O(n log n) on every real layout, and never
    more than ``budget`` steps.

    Boxes are numbered ``0..n-1``; ``lo[axis][i]`` and ``hi[axis][i]`` bound box ``i``. Two
    problems are solved, each on the axes still to compare: *among* (two boxes of one set that
    overlap) and *across* (a box of one set that overlaps one of another). Each first shrinks
    itself, at O(n log n):

    - an axis on which all the boxes share a coordinate separates none of them: dropped;
    - an axis on which the distinct intervals are pairwise disjoint (a partition: every axis of
      a grid, the rows of flattened ranges) separates every two boxes but those with the same
      interval there: the boxes are grouped by their intervals on all such axes, and each group
      is solved on the other axes alone (a grid's groups are single cells).

    What is left is solved on one axis by sorting, and on two by a sweep along the first that
    keeps the boxes spanning the sweep position in a max-tree of their ends on the second,
    keyed by their starts: a box overlaps one of them exactly when the largest end among those
    starting before its own end exceeds its start (O(log n) per box). On ``k >= 3`` axes a
    segment tree on one axis reduces it to ``k - 1``: two intervals overlap exactly when a tree
    node of one's decomposition is, or is an ancestor of, a node of the other's, so at each node
    the boxes stored there are solved among themselves and across those stored below it. Every
    box is stored at O(log n) nodes, so ``k`` such axes cost O(n log^(k-1) n) steps, too many
    for large ``k``; no algorithm does much better in general (finding two orthogonal vectors
    among ``n`` reduces to this problem, and is believed to take about n^2 steps in
    ``c log n`` dimensions).

    Real layouts never get there: every group that a grid, flattened ranges or a row or column
    split leaves varies on at most two axes (a grid of 100,000 chunks, 2-D or 3-D, takes about one
    step per chunk and bit of the count, under 0.1 s). Only a crafted chunk list varies on three or
    more axes at once without being a grid (a damaged one that overlaps mostly stops early), so
    only those reach ``budget``: about the time the ``.metadata`` unpickler took to read them.
    """

    def __init__(self, boxes: Sequence[Box]) -> None:
        ndim = len(boxes[0].offsets)
        self.n = len(boxes)
        self.lo = [[b.offsets[a] for b in boxes] for a in range(ndim)]
        self.hi = [[b.offsets[a] + b.sizes[a] for b in boxes] for a in range(ndim)]
        self.work = 0  # steps so far: boxes handled per axis, tree steps, pairs compared
        self.budget = self.n * (_BUDGET_PER_BIT * self.n.bit_length() + 4 * ndim * ndim) + _BUDGET_FLOOR

    def find(self) -> tuple[int, int] | None:
        """Two boxes that overlap, or None; _OverBudget past ``budget`` steps."""
        return self.among(list(range(self.n)), tuple(range(len(self.lo))))

    def _charge(self, steps: int) -> None:
        self.work += steps
        if self.work > self.budget:
            raise _OverBudget

    # -- two boxes of one set --------------------------------------------------------------------

    def among(self, ids: list[int], axes: tuple[int, ...]) -> tuple[int, int] | None:
        """Two of ``ids`` that overlap on ``axes`` (they overlap on every other axis)."""
        self._charge(len(ids) * (4 * len(axes) + 1))  # the shrinking below: a few passes per axis
        if len(ids) < 2:
            return None
        axes = self._separating(ids, axes)
        if not axes:
            return ids[0], ids[1]  # they overlap on every axis left to compare
        if len(ids) <= _BRUTE_FORCE:
            self._charge(len(ids) ** 2 * len(axes))
            return next(((x, y) for k, x in enumerate(ids) for y in ids[k + 1 :] if self._meet(x, y, axes)), None)
        if len(axes) == 1:
            return self._scan(ids, [], axes[0])
        parts = self._partitions(ids, axes)
        if parts:
            rest = tuple(a for a in axes if a not in parts)
            if not rest:  # a grid: two boxes overlap only if they are the same cell
                first: dict[tuple[int, ...], int] = {}
                for key, i in zip(self._keys(ids, parts), ids):
                    j = first.setdefault(key, i)
                    if j != i:
                        return j, i
                return None
            for group in self._groups(ids, parts).values():
                found = self.among(group, rest) if len(group) > 1 else None
                if found is not None:
                    return found
            return None
        if len(axes) == 2:
            return self._sweep(ids, [], axes)
        return self._split(ids, [], axes)

    # -- a box of one set and a box of the other ---------------------------------------------------

    def across(self, reds: list[int], blues: list[int], axes: tuple[int, ...]) -> tuple[int, int] | None:
        """A box of ``reds`` that overlaps one of ``blues`` on ``axes`` (two disjoint sets of
        boxes, every red one overlapping every blue one on the other axes)."""
        self._charge((len(reds) + len(blues)) * (4 * len(axes) + 1))
        if not reds or not blues:
            return None
        axes = self._separating(reds + blues, axes)
        if not axes:
            return reds[0], blues[0]
        if len(reds) * len(blues) <= _BRUTE_FORCE * _BRUTE_FORCE:
            self._charge(len(reds) * len(blues) * len(axes))
            return next(((x, y) for x in reds for y in blues if self._meet(x, y, axes)), None)
        if len(axes) == 1:
            return self._scan(reds, blues, axes[0])
        parts = self._partitions(reds + blues, axes)
        if parts:
            rest = tuple(a for a in axes if a not in parts)
            red_groups = self._groups(reds, parts)
            for key, group in self._groups(blues, parts).items():
                found = self.across(red_groups[key], group, rest) if key in red_groups else None
                if found is not None:
                    return found
            return None
        if len(axes) == 2:
            return self._sweep(reds, blues, axes)
        return self._split(reds, blues, axes)

    # -- shrinking -------------------------------------------------------------------------------

    def _meet(self, x: int, y: int, axes: tuple[int, ...]) -> bool:
        lo, hi = self.lo, self.hi
        return all(lo[a][x] < hi[a][y] and lo[a][y] < hi[a][x] for a in axes)

    def _separating(self, ids: list[int], axes: tuple[int, ...]) -> tuple[int, ...]:
        """``axes`` without those on which all of ``ids`` share a coordinate."""
        out = []
        for a in axes:
            if max(map(self.lo[a].__getitem__, ids)) >= min(map(self.hi[a].__getitem__, ids)):
                out.append(a)
        return tuple(out)

    def _partitions(self, ids: list[int], axes: tuple[int, ...]) -> tuple[int, ...]:
        """Those of ``axes`` on which the distinct intervals of ``ids`` are pairwise disjoint."""
        out = []
        for a in axes:
            spans = sorted(set(zip(map(self.lo[a].__getitem__, ids), map(self.hi[a].__getitem__, ids))))
            if all(s[1] <= t[0] for s, t in zip(spans, spans[1:])):
                out.append(a)
        return tuple(out)

    def _keys(self, ids: list[int], axes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        return zip(*(map(self.lo[a].__getitem__, ids) for a in axes))

    def _groups(self, ids: list[int], axes: tuple[int, ...]) -> dict[tuple[int, ...], list[int]]:
        """``ids`` by their starts on ``axes`` (on a partition axis the start names the interval)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for key, i in zip(self._keys(ids, axes), ids):
            if key in groups:
                groups[key].append(i)
            else:
                groups[key] = [i]
        return groups

    # -- what is left: one axis, two, more -------------------------------------------------------
    # ``blues`` empty means the *among* problem on ``reds``, else the *across* problem.

    def _scan(self, reds: list[int], blues: list[int], a: int) -> tuple[int, int] | None:
        """By start on axis ``a``: an interval overlaps an earlier one exactly when it starts
        before the furthest end so far (the other set's, for *across*)."""
        lo, hi = self.lo[a], self.hi[a]
        self._charge(len(reds) + len(blues))
        colour = dict.fromkeys(reds, 0) | dict.fromkeys(blues, 1)
        best = [-1, -1]  # per set: the box reaching furthest so far
        for i in sorted(colour, key=lo.__getitem__):
            c = colour[i]
            other = best[1 - c] if blues else best[c]
            if other >= 0 and lo[i] < hi[other]:
                return other, i
            if best[c] < 0 or hi[i] > hi[best[c]]:
                best[c] = i
        return None

    def _sweep(self, reds: list[int], blues: list[int], axes: tuple[int, ...]) -> tuple[int, int] | None:
        """Along axis ``a``, keeping the boxes met so far in a max-tree per set of their ends on
        axis ``b``, keyed by their starts there. Those that end on axis ``a`` before the sweep
        position are removed when they come up as a best (none after it reaches them either)."""
        a, b = axes
        lo_a, hi_a, lo_b, hi_b = self.lo[a], self.hi[a], self.lo[b], self.hi[b]
        sets = [reds, blues] if blues else [reds]
        colour = {i: c for c, ids in enumerate(sets) for i in ids}
        self._charge(len(colour) * (3 * len(colour).bit_length() + 1))
        floor = min(lo_b[i] for i in colour)  # below every start, so below every end
        keyed = [sorted(ids, key=lo_b.__getitem__) for ids in sets]
        starts = [[lo_b[i] for i in ids] for ids in keyed]
        slot = {i: k for ids in keyed for k, i in enumerate(ids)}
        trees = [_MaxTree(len(ids), floor) for ids in keyed]
        for i in sorted(colour, key=lo_a.__getitem__):
            c = colour[i]
            other = 1 - c if blues else c
            tree, boxes = trees[other], keyed[other]
            p = bisect.bisect_left(starts[other], hi_b[i])  # those starting before it ends on b
            while (k := tree.best(p)) >= 0:
                j = boxes[k]
                if hi_a[j] > lo_a[i]:
                    if hi_b[j] > lo_b[i]:
                        return j, i
                    break
                tree.clear(k)  # it ended before ``i`` starts on axis a
            trees[c].put(slot[i], hi_b[i])
        return None

    def _split(self, reds: list[int], blues: list[int], axes: tuple[int, ...]) -> tuple[int, int] | None:
        """A segment tree on the axis with the fewest distinct coordinates: each box is stored at
        the nodes that partition its interval there and listed at their ancestors (``below``).
        Two boxes overlap on that axis exactly when one is stored at a node where the other is
        stored or listed; those pairs are compared on the other axes."""
        lo, hi = self.lo, self.hi
        everyone = reds + blues
        self._charge(len(everyone) * (3 * len(axes) + 1))
        a = min(axes, key=lambda ax: len({lo[ax][i] for i in everyone} | {hi[ax][i] for i in everyone}))
        rest = tuple(ax for ax in axes if ax != a)
        coords = sorted({lo[a][i] for i in everyone} | {hi[a][i] for i in everyone})
        at = {x: k for k, x in enumerate(coords)}
        size = 1 << max(len(coords) - 2, 0).bit_length()  # leaves: the intervals between coords
        tables = []
        for ids in (reds, blues):
            stored: dict[int, list[int]] = {}
            below: dict[int, list[int]] = {}
            for i in ids:
                seen: set[int] = set()
                nodes = _canonical(at[lo[a][i]], at[hi[a][i]], size)
                for node in nodes:
                    stored.setdefault(node, []).append(i)
                    up = node >> 1
                    while up and up not in seen:  # above a node listed already, all are
                        seen.add(up)
                        below.setdefault(up, []).append(i)
                        up >>= 1
                self._charge(4 * (len(nodes) + len(seen)))
            tables.append((stored, below))
        (red_stored, red_below), (blue_stored, blue_below) = tables
        if not blues:
            for node, here in red_stored.items():
                found = self.among(here, rest) or self.across(here, red_below.get(node, []), rest)
                if found is not None:
                    return found
            return None
        for node in red_stored.keys() | blue_stored.keys():
            red_here, blue_here = red_stored.get(node, []), blue_stored.get(node, [])
            found = self.across(red_here, blue_here + blue_below.get(node, []), rest) or self.across(
                red_below.get(node, []), blue_here, rest
            )
            if found is not None:
                return found
        return None


# The most steps OverlapSearch takes: this many per box and per bit of the box count, plus what
# shrinking may cost on every axis (a few passes per axis and level), plus a floor that lets
# small counts always finish. Layouts that vary on at most two axes (every real one) take at
# most 5 per box and bit; crafted ones are stopped after 32 (at under 0.1 us a step: 100,000
# crafted chunks of 3 to 8 axes in 5 to 7 s on a 2-core machine), about what the .metadata
# unpickler spent reading them (70-130 us per chunk).
_BUDGET_PER_BIT = 32
_BUDGET_FLOOR = 1 << 20
