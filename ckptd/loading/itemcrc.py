"""Checking a stored item's recorded checksum as a load reads it: which of its bytes the plan reads.

A plan that reads every element of an item in one copy (:func:`covers_whole`) checks the item's
checksum over the bytes as they arrive, in file order (:class:`RunningCrc`); one that reads only
part of it checks the checksum blocks holding what it read (:func:`touched_blocks`). The reads
themselves, and when each check applies, are ckptd.loading.execute's.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from ..format.checksum import Checksum
from ..format.geometry import strides
from .plan import ItemReads
from .rawitem import RawLayout


class RunningCrc:
    """The checksum of one item's bytes, fed in file order; ``ok`` turns False for good if a piece
    arrives out of order (the caller then checks the item by reading it again).

    :meth:`add_later` checksums a piece on ``helper`` (one thread: pieces are checksummed in the
    order they were added) while the caller reads the next one; CRC-32C releases the GIL, so the
    two overlap. Same-layout load of 512 MiB in 64 MiB tensors, warm page cache, 2-core CI
    machine, best of 30 interleaved runs: 136 ms without checksums, 156 ms with the helper, 185 ms
    checksumming each block on the loading thread; with the other core busy with other work the
    helper gains nothing (medians 322 ms against 301 ms). :attr:`value` waits for the pieces still
    being checksummed.
    """

    def __init__(self, checksum: Checksum, start: int, helper: ThreadPoolExecutor | None = None) -> None:
        self.checksum = checksum
        self.pos = start
        self.crc = 0
        self.ok = True
        self._helper = helper
        self._last: Future[None] | None = None

    def add(self, offset: int, data: memoryview | bytes) -> None:
        if self._advance(offset, len(data)):
            self.settle()
            self.crc = self.checksum(data, self.crc)

    def add_later(self, offset: int, data: memoryview) -> None:
        """As :meth:`add`, computed on the helper thread; ``data`` must stay unchanged until
        :attr:`value` returned."""
        if self._helper is None:
            self.add(offset, data)
        elif self._advance(offset, len(data)):
            self._last = self._helper.submit(self._fold, data)

    def _fold(self, data: memoryview) -> None:
        self.crc = self.checksum(data, self.crc)

    def _advance(self, offset: int, nbytes: int) -> bool:
        if not self.ok or offset != self.pos:
            self.ok = False
            return False
        self.pos += nbytes
        return True

    def settle(self) -> None:
        """Wait for the pieces still being checksummed (raises what checksumming raised)."""
        if self._last is not None:
            last, self._last = self._last, None
            last.result()

    @property
    def value(self) -> int:
        self.settle()
        return self.crc


def covers_whole(entry: ItemReads) -> bool:
    """Whether the plan reads every element of the item, in one copy."""
    if len(entry.copies) != 1:
        return False
    op, shape = entry.copies[0], tuple(entry.item.shape)
    return (
        op.elem_offset == 0 and tuple(op.array_shape) == shape and tuple(op.sizes) == shape and not any(op.src_origin)
    )


def _spans(entry: ItemReads, layout: RawLayout) -> Iterator[tuple[int, int]]:
    """File bytes ``[lo, hi)`` from the first to the last element of each copy of ``entry``."""
    esize = entry.dtype.itemsize
    for op in entry.copies:
        if any(n == 0 for n in op.sizes):
            continue
        st = strides(op.array_shape)
        first = op.elem_offset + sum(o * s for o, s in zip(op.src_origin, st))
        last = op.elem_offset + sum((o + n - 1) * s for o, n, s in zip(op.src_origin, op.sizes, st))
        yield layout.data_offset + first * esize, layout.data_offset + (last + 1) * esize


def touched_blocks(entry: ItemReads, layout: RawLayout) -> list[int]:
    """The checksum blocks (``item.block_nbytes`` each) of ``entry``'s item, in file order, that hold
    the elements the plan reads and the headers they were found through (``layout.relied_on``: a
    flipped offset there shifts every element read, out of blocks that are intact)."""
    item = entry.item
    size = item.block_nbytes
    touched: set[int] = set()
    for lo, hi in [*_spans(entry, layout), *((off, off + n) for off, n in layout.relied_on)]:
        touched.update(range((lo - item.file_offset) // size, (hi - 1 - item.file_offset) // size + 1))
    return sorted(touched)


__all__ = ["RunningCrc", "covers_whole", "touched_blocks"]
