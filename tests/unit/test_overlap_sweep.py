"""The overlap check of ``validate_records`` (run by every commit and by ``ckptd verify``): a sweep
that finds exactly the overlapping N-D boxes a brute-force pairwise check finds, and compares
only a few pairs per chunk on layouts split along up to two axes (4,000 chunks of one row took
10.7 s pairwise)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.errors import ShardingError
from ckptd.format import geometry
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.format.validate import validate_records


def _chunk(rank: int, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ItemRecord:
    return ItemRecord(
        fqn="t", kind=TENSOR, rank=rank, dtype="float32", global_shape=shape, offsets=offsets, sizes=sizes
    )


def _brute_force_overlap(chunks: list[ItemRecord]) -> bool:
    return any(
        math.prod(a.sizes) and math.prod(b.sizes) and geometry.boxes_overlap(a, b)
        for a, b in itertools.combinations(chunks, 2)
    )


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


class _CountingOverlap:
    """Counts full box comparisons; fails at once past ``limit`` (a pairwise check would do n²/2)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls = 0
        self.real = geometry.boxes_overlap

    def __call__(self, a: ItemRecord, b: ItemRecord) -> bool:
        self.calls += 1
        assert self.calls <= self.limit, f"more than {self.limit} box comparisons"
        return self.real(a, b)


@pytest.mark.parametrize("layout", ["one row", "one column", "grid", "3-D, two axes split"])
def test_large_layouts_compare_few_pairs_and_still_find_an_overlap(layout, monkeypatch):
    if layout == "one row":
        chunks = [_chunk(i, (1, 4000 * 3), (0, 3 * i), (1, 3)) for i in range(4000)]
    elif layout == "one column":
        chunks = [_chunk(i, (4000, 2), (i, 0), (1, 2)) for i in range(4000)]
    elif layout == "grid":
        chunks = [_chunk(64 * i + j, (64 * 2, 64 * 5), (2 * i, 5 * j), (2, 5)) for i in range(64) for j in range(64)]
    else:  # experts x rows x columns, split by expert and by column (as expert parallelism does)
        chunks = [_chunk(i, (8, 4, 512 * 2), (i // 512, 0, 2 * (i % 512)), (1, 4, 2)) for i in range(4096)]
    counter = _CountingOverlap(limit=4 * len(chunks))
    monkeypatch.setattr(geometry, "boxes_overlap", counter)
    validate_records(chunks)  # a valid partition: no error
    # Grow the first chunk into its neighbour: the overlap is found and both ranks are named.
    first = chunks[0]
    axis = max(ax for ax, n in enumerate(first.global_shape) if first.sizes[ax] < n)
    sizes = tuple(s + (ax == axis) for ax, s in enumerate(first.sizes))
    counter.calls = 0
    with pytest.raises(ShardingError, match=r"rank 0 .* overlaps the chunk of rank \d+"):
        validate_records([_chunk(0, first.global_shape, first.offsets, sizes)] + chunks[1:])
