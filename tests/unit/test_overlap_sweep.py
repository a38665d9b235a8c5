"""The overlap check of ``validate_records`` (every commit, ``ckptd verify``) and of every load
(``CheckpointView.of_index``, for every stored tensor): it finds exactly the overlapping N-D boxes
a brute-force pairwise check finds, takes a few steps per chunk on real layouts, stays near
n log n steps on chunk lists crafted to make a sweep compare every pair (4,000 chunks of one row
took 10.7 s pairwise; 8,000 crafted chunks made a load of another key take 22 s), and refuses,
naming the tensor, a crafted list that would need more than its budget."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.errors import CorruptCheckpointError, ShardingError
from ckptd.format import geometry
from ckptd.format.geometry import OverlapCheckRefused, OverlapSearch, find_overlap, flat_range_boxes
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.format.validate import validate_records


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _chunk(rank: int, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ItemRecord:
    return ItemRecord(
        fqn="t", kind=TENSOR, rank=rank, dtype="float32", global_shape=shape, offsets=offsets, sizes=sizes
    )


def _brute_force_overlap(chunks) -> bool:
    return any(
        math.prod(a.sizes) and math.prod(b.sizes) and geometry.boxes_overlap(a, b)
        for a, b in itertools.combinations(chunks, 2)
    )


def _check_exact(boxes) -> None:
    found = find_overlap(boxes)
    assert (found is not None) == _brute_force_overlap(boxes), boxes
    if found is not None:
        a, b = found
        at = {id(box): k for k, box in reversed(list(enumerate(boxes)))}  # equal boxes: by identity
        assert geometry.boxes_overlap(a, b) and at[id(a)] < at[id(b)]


@st.composite
def _boxes(draw: st.DrawFn) -> list[ItemRecord]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    out = []
    for rank in range(draw(st.integers(2, 9))):
        offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
        sizes = tuple(draw(st.integers(0, n - o)) for o, n in zip(offsets, shape))
        out.append(_chunk(rank, shape, offsets, sizes))
    return out


@settings(max_examples=300, deadline=None)
@given(_boxes())
def test_sweep_finds_an_overlap_exactly_when_brute_force_does(chunks):
    if len({c.offsets for c in chunks}) < len(chunks):
        chunks = list({c.offsets: c for c in chunks}.values())  # equal offsets: another check
    boxes = [c for c in chunks if math.prod(c.sizes)]
    found = geometry.find_overlap(boxes) if len(boxes) > 1 else None
    assert (found is not None) == _brute_force_overlap(chunks), chunks
    if found is not None:
        assert geometry.boxes_overlap(*found)


def _mostly_disjoint(rng: random.Random, ndim: int, extent: int, tries: int) -> list[Box]:
    """Random boxes kept only if they meet none kept before (so the search cannot stop early),
    sometimes plus one that may meet some."""
    out: list[Box] = []
    for _ in range(tries):
        offsets = tuple(rng.randrange(extent) for _ in range(ndim))
        sizes = tuple(rng.randint(1, max(1, min(extent - o, rng.choice([1, 2, 4, extent])))) for o in offsets)
        box = Box(offsets, sizes)
        if not any(geometry.boxes_overlap(box, other) for other in out):
            out.append(box)
    if rng.random() < 0.5:
        out.insert(rng.randrange(len(out) + 1), Box(tuple(rng.randrange(extent) for _ in range(ndim)), (1,) * ndim))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("brute_force", [1, geometry._BRUTE_FORCE])
@pytest.mark.parametrize("ndim", [2, 3, 4])
def test_every_strategy_is_exact_on_sets_that_do_not_stop_early(monkeypatch, brute_force, ndim):
    # Pairwise comparison of small sets off (1): every set reaches the sweep and the segment trees.
    monkeypatch.setattr(geometry, "_BRUTE_FORCE", brute_force)
    rng = random.Random(ndim * 100 + brute_force)
    for _ in range(150):
        _check_exact(_mostly_disjoint(rng, ndim, rng.randint(3, 30), rng.randint(10, 120)))


def _flat_ranges(shape: tuple[int, ...], ranks: int) -> list[ItemRecord]:
    """Megatron-Core's flattened ranges (the distributed optimizer): each rank a contiguous range
    of the row-major tensor, as the boxes a load reads it in."""
    total, out = math.prod(shape), []
    for rank in range(ranks):
        start, stop = rank * total // ranks, (rank + 1) * total // ranks
        out += [_chunk(rank, shape, o, s) for o, s, _ in flat_range_boxes(shape, start, stop)]
    return out


def _layout(layout: str) -> list[ItemRecord]:
    if layout == "one row":
        return [_chunk(i, (1, 4000 * 3), (0, 3 * i), (1, 3)) for i in range(4000)]
    if layout == "one column":
        return [_chunk(i, (4000, 2), (i, 0), (1, 2)) for i in range(4000)]
    if layout == "grid":
        return [_chunk(64 * i + j, (64 * 2, 64 * 5), (2 * i, 5 * j), (2, 5)) for i in range(64) for j in range(64)]
    if layout == "uneven grid of 100,000":
        rows, cols = [0, *sorted(random.Random(1).sample(range(1, 5000), 315)), 5000], range(0, 317 * 3, 3)
        return [_chunk(0, (5000, 316 * 3), (r, c), (r1 - r, 3)) for r, r1 in zip(rows, rows[1:]) for c in cols[:-1]]
    if layout == "3-D, two axes split":  # experts x rows x columns, by expert and by column
        return [_chunk(i, (8, 4, 512 * 2), (i // 512, 0, 2 * (i % 512)), (1, 4, 2)) for i in range(4096)]
    if layout == "3-D grid of 97,336":
        return [_chunk(0, (46, 46, 46), (i, j, k), (1, 1, 1)) for i in range(46) for j in range(46) for k in range(46)]
    if layout == "flattened ranges, 2-D":
        return _flat_ranges((1000, 999), 4096)
    assert layout == "flattened ranges, 3-D"
    return _flat_ranges((30, 100, 77), 4096)


@pytest.mark.parametrize(
    "layout",
    [
        "one row",
        "one column",
        "grid",
        "uneven grid of 100,000",
        "3-D, two axes split",
        "3-D grid of 97,336",
        "flattened ranges, 2-D",
        "flattened ranges, 3-D",
    ],
)
def test_real_layouts_take_a_few_steps_per_chunk_and_an_overlap_is_still_found(layout):
    chunks = _layout(layout)
    search = OverlapSearch(chunks)
    assert search.find() is None
    n = len(chunks)
    assert search.work <= 3 * n * n.bit_length(), search.work  # budget: 32 per chunk and bit
    if len(chunks) > 20_000:
        return
    validate_records(chunks)  # a valid partition: no error
    # Grow the first chunk into its neighbour: the overlap is found and both ranks are named.
    first = chunks[0]
    axis = max(ax for ax, n in enumerate(first.global_shape) if first.sizes[ax] < n)
    sizes = tuple(s + (ax == axis) for ax, s in enumerate(first.sizes))
    with pytest.raises(ShardingError, match=r"rank 0 .* overlaps the chunk of rank \d+"):
        validate_records([_chunk(0, first.global_shape, first.offsets, sizes)] + chunks[1:])


def _staircase(n: int, ndim: int = 2) -> list[Box]:
    """The review's crafted chunk list: a staircase of columns below one wide row. Each column
    starts where the previous one does, one further on both axes, so a sweep that compares a box
    with those spanning the sweep position within the widest box's reach (the wide row's: all of
    them) compared every pair. Stacked on further axes, with a box across them, for ``ndim > 2``."""
    out = []
    for extra in itertools.product(range(2), repeat=ndim - 2):
        out += [Box((i, i, *extra), (n - i, 1, *(1,) * (ndim - 2))) for i in range(n)]
    out.append(Box((n, 0, *(0,) * (ndim - 2)), (1, n, *(2,) * (ndim - 2))))
    return out


@pytest.mark.parametrize("ndim", [2, 3])
def test_a_crafted_staircase_takes_n_log_n_steps_and_its_one_overlap_is_found(ndim):
    boxes = _staircase(20_000 // 2 ** (ndim - 2), ndim)
    n = len(boxes)
    search = OverlapSearch(boxes)
    assert search.find() is None
    assert search.work <= 8 * n * n.bit_length(), search.work  # pairwise: n^2 / 2 = 2e8
    # One column reaching one further row overlaps the wide row: found, with both boxes.
    column = boxes[n // 2]
    longer = Box(column.offsets, (column.sizes[0] + 1, *column.sizes[1:]))
    found = find_overlap([*boxes[: n // 2], longer, *boxes[n // 2 + 1 :]])
    assert found == (longer, boxes[-1])


@pytest.mark.timeout(60)  # the sweep it replaces: 24 s for 8,000 boxes, minutes for these
def test_a_crafted_staircase_of_40000_chunks_is_checked_at_once():
    assert find_overlap(_staircase(40_000)) is None


def _crafted_4d(n: int) -> list[ItemRecord]:
    """Each chunk one element thick on one of four axes (its own place there) and reaching the
    far end from a random start on the other three: no two overlap, and no axis is a partition
    or shared by all, so every group varies on four axes at once (O(n log^3 n) steps)."""
    rng = random.Random(4)
    far = 10 * n
    out = []
    for i in range(n):
        thin = i % 4
        starts = [i // 4 if ax == thin else rng.randrange(n, far - 1) for ax in range(4)]
        sizes = [1 if ax == thin else far - s for ax, s in enumerate(starts)]
        out.append(_chunk(i, (far,) * 4, tuple(starts), tuple(sizes)))
    return out


def test_a_crafted_list_past_the_budget_is_refused_naming_the_tensor():
    chunks = _crafted_4d(4000)
    search = OverlapSearch(chunks)
    with pytest.raises(geometry._OverBudget):
        search.find()
    assert search.budget < search.work <= search.budget + 64 * len(chunks)  # stops at once
    with pytest.raises(OverlapCheckRefused, match=r"tensor 'w': its 4000 chunks .* more than \d+ steps"):
        find_overlap(chunks, "tensor 'w'")
    assert issubclass(OverlapCheckRefused, CorruptCheckpointError)  # what a load raises
    # A commit's (and `ckptd verify`'s) check raises it as a ShardingError naming the key.
    with pytest.raises(ShardingError, match=r"tensor 't': its 4000 chunks vary on several axes"):
        validate_records(chunks)
    # Below the budget the same kind of list is checked exactly.
    small = _crafted_4d(300)
    assert find_overlap(small) is None
    assert find_overlap([*small, _chunk(9, small[0].global_shape, small[7].offsets, (1, 1, 1, 1))]) is not None
