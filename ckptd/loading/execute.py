"""Executing a read plan: only the needed byte ranges, straight into the destinations.

For each stored item (in file order) the raw element bytes are located inside its
``torch.save`` stream (:mod:`.rawitem`); then every copy takes one of two paths:

- *direct* (one contiguous run, or runs >= ``direct_min_bytes``): positional vectored reads
  (``preadv``) land each run in its destination tensor; small gaps between runs in the file are
  read into a throw-away sink so that one system call covers many runs. A same-layout load is
  one read per chunk, into the caller's tensor.
- *strided* (many short runs, e.g. a column block of a row-major chunk): the copy is cut into
  slabs spanning from the first to the last needed element; each slab is mapped read-only
  (``mmap``, only the touched pages are read, unmapped right after) and copied with one strided
  tensor copy. Without mmap (``use_mmap=False`` or a filesystem that refuses it) each slab is
  read with ``preadv`` into a scratch buffer of at most ``window_bytes``.

Items that are not plain contiguous tensor streams fall back to ``torch.load`` of the item.
Extra memory is thus bounded by one slab (plus whole fallback items), whatever the tensor sizes.

**Checksums.** An item whose CRC-32C was recorded at save time is checked as it is read when the
plan reads all of it (one copy covering the whole chunk: every same-layout load, and any load
onto a coarser layout): the bytes are checksummed in file order as they arrive
(:class:`.itemcrc.RunningCrc`), in blocks of ``_CRC_BLOCK_NBYTES`` read and checksummed while still
in the CPU cache, plus the item's few header bytes. A plan that reads only part of an item (a finer
layout) checks the 4 MiB blocks holding the elements it read (ckptd.format.checksum: block
checksums), reading those blocks again after the copy (from the page cache, mostly); an item of
one block is read again whole. A checkpoint without block checksums (ckptd before them) has its
items read in part checked when they are at most 64 KiB (locating their elements read them whole
already) or with ``ExecOptions.verify_partial`` (a resume asks for it: the whole item is read again
and checked), else not (``LoadStats.items_unverified``; ``ckptd verify`` checks every byte). A
mismatch raises CorruptCheckpointError naming key, chunk, file and byte range, after the
destination may already hold the damaged bytes.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError
from ..format.archive import is_zip_stream, torch_save_problem
from ..format.checksum import Checksum, unpack_blocks
from ..format.geometry import Shape, count_runs, enumerate_runs, run_length, strides
from ..format.reader import DataFiles, RangeSource, check_checksum, checksum_mismatch, load_tensor_bytes, read_error
from .itemcrc import RunningCrc, covers_whole, touched_blocks
from .plan import CopyOp, ItemReads, ReadPlan
from .rawitem import SMALL_ITEM_NBYTES, RawLayout, locate

log = logging.getLogger("ckptd.loading")

_MADV_POPULATE_READ = 22 if os.uname().sysname == "Linux" else None  # Linux >= 5.14
_DENSE_FRACTION = 0.9
# Reads of a checked item go in blocks of this size, each checksummed right after it landed.
_CRC_BLOCK_NBYTES = 4 << 20
# A partly read item up to this size is checked too: locating its elements read all of it
# already (ckptd.loading.rawitem reads items up to this size whole).
_VERIFY_WHOLE_NBYTES = SMALL_ITEM_NBYTES

try:
    _IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024


@dataclass
class ExecOptions:
    """Tuning knobs of plan execution."""

    direct_min_bytes: int = 256 * 1024
    gap_fill_bytes: int = 16 * 1024
    window_bytes: int = 16 * 1024 * 1024
    use_mmap: bool = True
    map_window_bytes: int = 64 * 1024 * 1024
    max_enumerated_runs: int = 1 << 16
    # Check an item read only in part (larger than 64 KiB) of a checkpoint without block checksums
    # against its recorded checksum by reading all of it again (see the module docstring).
    verify_partial: bool = False


@dataclass
class LoadStats:
    """What one load did (filled by :func:`execute`; pass ``stats=`` to ``ckptd.load``)."""

    items: int = 0
    raw_items: int = 0
    fallback_items: int = 0
    bytes_copied: int = 0  # elements delivered to destinations, in bytes
    bytes_read: int = 0  # bytes read from data files (headers, gaps and fallbacks included)
    read_calls: int = 0
    bytes_mapped: int = 0  # span of strided copies served from a read-only mapping
    peak_scratch_bytes: int = 0
    items_verified: int = 0  # items whose recorded checksum was checked
    items_unverified: int = 0  # items with a recorded checksum read only in part (not checked)

    def merge(self, other: LoadStats) -> None:
        for name in (
            "items",
            "raw_items",
            "fallback_items",
            "bytes_copied",
            "bytes_read",
            "read_calls",
            "bytes_mapped",
            "items_verified",
            "items_unverified",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.peak_scratch_bytes = max(self.peak_scratch_bytes, other.peak_scratch_bytes)


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor's elements (no copy)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _Executor:
    def __init__(self, files: DataFiles, opts: ExecOptions, stats: LoadStats, checksum: Checksum | None) -> None:
        self.files = files
        self.opts = opts
        self.stats = stats
        self.checksum = checksum
        self._views: dict[int, memoryview] = {}
        self._sink = memoryview(bytearray(opts.gap_fill_bytes))
        self._scratch: torch.Tensor | None = None
        self._use_mmap = opts.use_mmap
        self._crc: RunningCrc | None = None  # the item being read and checked, if any
        self._entry: ItemReads | None = None  # the item being read (for errors)
        self.helper: ThreadPoolExecutor | None = None  # checksums blocks while the next is read

    # --- reading -------------------------------------------------------------------------
    def _pread(self, fd: int, offset: int, n: int) -> bytes:
        self.stats.read_calls += 1
        self.stats.bytes_read += n
        data = os.pread(fd, n, offset)
        if len(data) != n:
            where = self.item_what(self._entry) if self._entry is not None else "a data file"
            raise CorruptCheckpointError(
                f"{where}: the file ended early (read {len(data)} of {n} bytes at offset {offset}): it was "
                "truncated or replaced while it was read. Load an earlier checkpoint"
            )
        return data

    def _preadv(self, fd: int, buffers: list[memoryview], offset: int, what: str) -> None:
        total = sum(len(b) for b in buffers)
        done = 0
        while done < total:
            self.stats.read_calls += 1
            n = os.preadv(fd, buffers, offset + done)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"{what}: the data file ended early (read {done} of {total} bytes at offset "
                    f"{offset}); the checkpoint is truncated. Load an earlier checkpoint."
                )
            done += n
            if done < total:  # partial read: drop what is filled, continue with the rest
                while buffers and n >= len(buffers[0]):
                    n -= len(buffers[0])
                    buffers = buffers[1:]
                if n:
                    buffers = [buffers[0][n:]] + buffers[1:]
        self.stats.bytes_read += total

    def _dst_view(self, t: torch.Tensor) -> memoryview:
        key = id(t)
        mv = self._views.get(key)
        if mv is None:
            mv = self._views[key] = byte_view(t)
        return mv

    def _scratch_bytes(self, n: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(max(n, 1), dtype=torch.uint8)
            self.stats.peak_scratch_bytes = max(self.stats.peak_scratch_bytes, self._scratch.numel())
        return self._scratch[:n]

    # --- one item ------------------------------------------------------------------------
    def run_item(self, entry: ItemReads) -> None:
        item = entry.item
        self._entry = entry
        fd, size = self.files.fileno_and_size(item.relative_path)
        if item.file_offset >= 0 and item.length >= 0 and item.file_offset + item.length <= size:
            self.files.ensure(item.relative_path, item.file_offset, item.length)
        where = f"{entry.what} in {self.files.directory / item.relative_path}"
        if item.file_offset < 0 or item.length < 0 or item.file_offset + item.length > size:
            raise CorruptCheckpointError(
                f"data file {self.files.directory / item.relative_path} is truncated: {entry.what} "
                f"needs bytes [{item.file_offset}, {item.file_offset + item.length}) but the file "
                f"has {size}. Load an earlier checkpoint."
            )
        self.stats.items += 1
        before = self.stats.bytes_read
        probed: list[tuple[int, bytes]] = []  # what locate() read: the item's headers, mostly

        def read(off: int, n: int) -> bytes:
            data = self._pread(fd, off, n)
            probed.append((off, data))
            return data

        layout = locate(read, item.file_offset, item.length, entry.dtype, item.shape)
        esize = entry.dtype.itemsize
        if layout is None or layout.nbytes != math.prod(item.shape) * esize:
            self.stats.bytes_read = before  # the probe's bytes are re-read whole below
            self._fallback(entry, where)
            return
        self.stats.raw_items += 1
        checksum, recorded = self.checksum, item.crc
        crc = None
        if checksum is not None and recorded is not None and covers_whole(entry):
            if self.helper is None and layout.nbytes > _CRC_BLOCK_NBYTES:
                self.helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-load-crc")
            crc = RunningCrc(checksum, item.file_offset, self.helper)
            crc.add(item.file_offset, self._span(fd, item.file_offset, layout.data_offset, probed))
        elif layout.record_crc32 is not None and covers_whole(entry):
            # No checksum of ckptd's (torch DCP, Megatron-Core, checksums=False): the CRC-32 the
            # archive records for the elements, computed as they are read.
            if self.helper is None and layout.nbytes > _CRC_BLOCK_NBYTES:
                self.helper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-load-crc")
            crc = RunningCrc(zlib.crc32, layout.data_offset, self.helper)
        self._crc = crc
        try:
            for op in entry.copies:
                self.stats.bytes_copied += math.prod(op.sizes) * esize
                self._copy_raw(fd, layout, esize, op, where)
        finally:
            self._crc = None
            if crc is not None:
                crc.settle()  # no checksum may still read the destination once the item is done
        if checksum is None or recorded is None:
            self._check_archive_crc(fd, entry, layout, crc, probed)
            return
        if crc is not None:
            end = item.file_offset + item.length
            data_end = layout.data_offset + layout.nbytes
            if crc.ok and crc.pos == data_end:
                for off, piece in self._blocks(fd, data_end, end, probed):
                    crc.add(off, piece)
            if crc.ok and crc.pos == end:
                checksum_mismatch(crc.value, recorded, checksum, self.item_what(entry))
                self.stats.items_verified += 1
            else:  # not fed in file order: check it by reading it again
                self._verify_by_reading(fd, entry, checksum, recorded, [])
        elif item.block_crcs:
            self._verify_blocks(fd, entry, layout, checksum)
        elif item.length <= max(_VERIFY_WHOLE_NBYTES, item.block_nbytes) or self.opts.verify_partial:
            # One block (or small): its checksum is the item's, so all of it is read again.
            self._verify_by_reading(fd, entry, checksum, recorded, probed)
        else:
            self.stats.items_unverified += 1

    def _check_archive_crc(
        self, fd: int, entry: ItemReads, layout: RawLayout, crc: RunningCrc | None, probed: list[tuple[int, bytes]]
    ) -> None:
        """An item without a checksum of ckptd's: its elements against the CRC-32 its ``torch.save``
        archive records, when the load read all of them (or ``verify_partial``: read again whole);
        else it counts as unverified, as an item read in part without block checksums does."""
        want = layout.record_crc32
        if want is None or (crc is None and not self.opts.verify_partial):
            self.stats.items_unverified += 1
            return
        end = layout.data_offset + layout.nbytes
        if crc is None or not crc.ok or crc.pos != end:  # read in part, or not in file order
            crc = RunningCrc(zlib.crc32, layout.data_offset)
            for off, piece in self._blocks(fd, layout.data_offset, end, probed):
                crc.add(off, piece)
        if crc.value != want:
            raise CorruptCheckpointError(
                f"{self.item_what(entry)}: its elements' CRC-32 is {crc.value:08x} but its torch.save "
                f"archive records {want:08x}; the item is damaged (bit rot, or a torn write). Load an "
                "earlier checkpoint"
            )
        self.stats.items_verified += 1

    def item_what(self, entry: ItemReads) -> str:
        item = entry.item
        return (
            f"{entry.what} chunk at offsets {tuple(item.offsets)} (bytes [{item.file_offset}, "
            f"{item.file_offset + item.length}) of {self.files.directory / item.relative_path})"
        )

    def _span(self, fd: int, start: int, end: int, probed: list[tuple[int, bytes]]) -> bytes:
        """File bytes ``[start, end)`` of a few KiB: from what was probed, else read."""
        for off, data in probed:
            if off <= start and end <= off + len(data):
                return data[start - off : end - off]
        return self._pread(fd, start, end - start)

    def _blocks(self, fd: int, start: int, end: int, probed: list[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
        """File bytes ``[start, end)`` as ``(offset, bytes)`` pieces of at most a block each, read
        one at a time."""
        for pos in range(start, end, _CRC_BLOCK_NBYTES):
            yield pos, self._span(fd, pos, min(end, pos + _CRC_BLOCK_NBYTES), probed)

    def _verify_by_reading(
        self, fd: int, entry: ItemReads, checksum: Checksum, recorded: int, probed: list[tuple[int, bytes]]
    ) -> None:
        """Check an item's recorded checksum over all of its bytes: those ``probed`` already, the
        rest read block by block."""
        item = entry.item
        crc = RunningCrc(checksum, item.file_offset)
        for off, piece in self._blocks(fd, item.file_offset, item.file_offset + item.length, probed):
            crc.add(off, piece)
        checksum_mismatch(crc.value, recorded, checksum, self.item_what(entry))
        self.stats.items_verified += 1

    def _verify_blocks(self, fd: int, entry: ItemReads, layout: RawLayout, checksum: Checksum) -> None:
        """Check the blocks of an item read in part holding what the plan read (:func:`.itemcrc.touched_blocks`),
        each read again (the page cache has them, mostly) against its recorded block checksum."""
        item = entry.item
        crcs = unpack_blocks(item.block_crcs)
        size = item.block_nbytes
        for k in touched_blocks(entry, layout):
            start = item.file_offset + k * size
            end = min(item.file_offset + item.length, start + size)
            buf = byte_view(self._scratch_bytes(end - start))
            self._preadv(fd, [buf], start, entry.what)
            what = f"{self.item_what(entry)}, block {k} (bytes [{start}, {end}))"
            checksum_mismatch(checksum(buf, 0), crcs[k], checksum, what)
        self.stats.items_verified += 1

    def _fallback(self, entry: ItemReads, where: str) -> None:
        item = entry.item
        self.stats.fallback_items += 1
        data = self.files.read(item.relative_path, item.file_offset, item.length, entry.what)
        self.stats.read_calls += 1
        self.stats.bytes_read += len(data)
        if self.checksum is not None and item.crc is not None:
            check_checksum(data, item.crc, self.checksum, self.item_what(entry))
            self.stats.items_verified += 1
        elif is_zip_stream(data):  # no checksum of ckptd's: the archive's CRC-32s
            if (problem := torch_save_problem(data)) is not None:
                raise CorruptCheckpointError(
                    f"{self.item_what(entry)} {problem}; the item is damaged: load an earlier checkpoint"
                )
            self.stats.items_verified += 1
        source = load_tensor_bytes(data, entry.what, item.relative_path)
        del data
        if tuple(source.shape) != tuple(item.shape) or source.dtype != entry.dtype:
            raise CorruptCheckpointError(
                f"{where} is {source.dtype} {tuple(source.shape)} but the metadata says "
                f"{entry.dtype} {item.shape}; the checkpoint is damaged"
            )
        flat = source.reshape(-1)
        for op in entry.copies:
            array = flat[op.elem_offset : op.elem_offset + math.prod(op.array_shape)].view(op.array_shape)
            src = tuple(slice(o, o + s) for o, s in zip(op.src_origin, op.sizes))
            dst = tuple(slice(o, o + s) for o, s in zip(op.dst_offsets, op.sizes))
            op.dst[dst].copy_(array[src])
            self.stats.bytes_copied += math.prod(op.sizes) * source.element_size()

    def _copy_raw(self, fd: int, layout: RawLayout, esize: int, op: CopyOp, what: str) -> None:
        if op.sizes and math.prod(op.sizes) == 0:
            return
        if not op.sizes:  # a 0-d tensor: one element
            self._direct(fd, layout, esize, op, what)
            return
        dst_shape = tuple(op.dst.shape)
        run_bytes = run_length(op.sizes, op.array_shape, dst_shape) * esize
        nruns = count_runs(op.sizes, op.array_shape, dst_shape)
        if nruns == 1 or (run_bytes >= self.opts.direct_min_bytes and nruns <= self.opts.max_enumerated_runs):
            self._direct(fd, layout, esize, op, what)
        else:
            self._windowed(fd, layout, esize, op, what)

    def _direct(self, fd: int, layout: RawLayout, esize: int, op: CopyOp, what: str) -> None:
        runs = enumerate_runs(op.array_shape, op.src_origin, tuple(op.dst.shape), op.dst_offsets, op.sizes)
        base = layout.data_offset + op.elem_offset * esize
        run_bytes = runs.length * esize
        dst = self._dst_view(op.dst)
        batch: list[memoryview] = []
        batch_start = expected = 0
        for s, d in zip(runs.src_starts, runs.dst_starts):
            file_off = base + s * esize
            piece = dst[d * esize : d * esize + run_bytes]
            gap = file_off - expected
            if batch and gap == 0 and len(batch) < _IOV_MAX:
                batch.append(piece)
            elif batch and 0 < gap <= len(self._sink) and len(batch) + 1 < _IOV_MAX:
                batch.append(self._sink[:gap])
                batch.append(piece)
            else:
                if batch:
                    self._read_batch(fd, batch, batch_start, what)
                batch = [piece]
                batch_start = file_off
            expected = file_off + run_bytes
        if batch:
            self._read_batch(fd, batch, batch_start, what)

    def _read_batch(self, fd: int, batch: list[memoryview], offset: int, what: str) -> None:
        """``preadv`` of contiguous file bytes into ``batch``; for an item being checked, in blocks
        of at most ``_CRC_BLOCK_NBYTES``, each checksummed right after it landed (still in cache)."""
        crc = self._crc
        if crc is None:
            self._preadv(fd, batch, offset, what)
            return
        group: list[memoryview] = []
        nbytes = 0
        for buf in batch:
            while len(buf):
                take = buf[: _CRC_BLOCK_NBYTES - nbytes]
                group.append(take)
                nbytes += len(take)
                buf = buf[len(take) :]
                if nbytes == _CRC_BLOCK_NBYTES:
                    self._read_group(fd, group, offset, what, crc)
                    offset += nbytes
                    group, nbytes = [], 0
        if group:
            self._read_group(fd, group, offset, what, crc)

    def _read_group(self, fd: int, group: list[memoryview], offset: int, what: str, crc: RunningCrc) -> None:
        self._preadv(fd, group, offset, what)
        for piece in group:
            crc.add_later(offset, piece)  # the destination's bytes: unchanged until the item is done
            offset += len(piece)

    def _windowed(self, fd: int, layout: RawLayout, esize: int, op: CopyOp, what: str) -> None:
        base = layout.data_offset + op.elem_offset * esize
        window = self.opts.map_window_bytes if self._use_mmap else self.opts.window_bytes
        self._slabs(fd, base, esize, op, (), window, what)

    def _slabs(
        self, fd: int, base: int, esize: int, op: CopyOp, prefix: tuple[int, ...], window: int, what: str
    ) -> None:
        """Copy the box with its first ``len(prefix)`` axes fixed, in slabs along the next axis."""
        a = len(prefix)
        shape = op.array_shape
        nd = len(shape)
        # Axes of extent 1 are fixed right away, so a slab is as tight as the box allows.
        while a < nd - 1 and op.sizes[a] == 1:
            prefix = prefix + (0,)
            a += 1
        st = strides(shape)
        row_bytes = st[a] * esize
        if row_bytes > window and a < nd - 1:
            for i in range(op.sizes[a]):
                self._slabs(fd, base, esize, op, prefix + (i,), window, what)
            return
        per = max(1, window // max(row_bytes, 1))
        lead = sum((op.src_origin[j] + prefix[j]) * st[j] for j in range(a))
        dst_lead = tuple(op.dst_offsets[j] + prefix[j] for j in range(a))
        inner_dst = tuple(slice(op.dst_offsets[j], op.dst_offsets[j] + op.sizes[j]) for j in range(a + 1, nd))
        # A slab spans from its first needed element to its last one; the box is a strided view.
        first = sum(op.src_origin[j] * st[j] for j in range(a + 1, nd))
        last = sum((op.src_origin[j] + op.sizes[j] - 1) * st[j] for j in range(a + 1, nd)) + 1
        box_strides = st[a:]
        # Dense: (nearly) every page of the span holds needed elements, so mapping all of its
        # pages up front reads nothing extra. Sparse spans fault in only the pages they touch.
        page = mmap.PAGESIZE
        run = (last - first) * esize
        dense = row_bytes <= page or (run + page) >= _DENSE_FRACTION * row_bytes
        for i0 in range(0, op.sizes[a], per):
            k = min(per, op.sizes[a] - i0)
            row0 = lead + (op.src_origin[a] + i0) * st[a]
            n_elems = (k - 1) * st[a] + last - first
            start = base + (row0 + first) * esize
            box = (k,) + tuple(op.sizes[a + 1 :])
            dst = op.dst[dst_lead + (slice(op.dst_offsets[a] + i0, op.dst_offsets[a] + i0 + k),) + inner_dst]
            if self._use_mmap and self._copy_mapped(fd, start, n_elems * esize, box, box_strides, dst, dense):
                continue
            buf = self._scratch_bytes(n_elems * esize)
            self._preadv(fd, [byte_view(buf)], start, what)
            if self._crc is not None:
                self._crc.add(start, byte_view(buf))
            dst.copy_(buf.view(op.dst.dtype).as_strided(box, box_strides, 0))

    def _copy_mapped(
        self, fd: int, start: int, nbytes: int, box: Shape, box_strides: Shape, dst: torch.Tensor, populate: bool
    ) -> bool:
        """Strided copy straight out of a private read-only mapping of ``[start, +nbytes)``.

        Only the pages holding needed elements are touched (so only those are read from the
        file), and the mapping is dropped right after the copy. Returns False if the file cannot
        be mapped or the elements would be misaligned in the mapping (the caller then reads
        with pread).
        """
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        if (start - aligned) % dst.element_size():
            # Items sit at any file offset, so elements in a mapping may be misaligned for their
            # type; copying complex128 from an address that is 8 mod 16 crashes the process
            # (SIGSEGV in copy_). pread into the aligned scratch buffer instead.
            return False
        try:
            mm = mmap.mmap(
                fd,
                nbytes + (start - aligned),
                flags=mmap.MAP_PRIVATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
                offset=aligned,
            )
        except (OSError, ValueError):
            self._use_mmap = False  # e.g. a filesystem without mmap: pread from now on
            return False
        try:
            self.stats.bytes_mapped += nbytes
            if populate and _MADV_POPULATE_READ is not None:
                try:  # map every page in one call instead of one fault per few pages
                    mm.madvise(_MADV_POPULATE_READ)
                except OSError:
                    pass  # older kernels: the copy faults the pages in instead
            flat = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start - aligned)
            src = flat.view(dst.dtype).as_strided(box, box_strides, 0)
            dst.copy_(src)
            if self._crc is not None:
                with memoryview(mm) as whole, whole[start - aligned : start - aligned + nbytes] as span:
                    self._crc.add(start, span)
            del src, flat
        finally:
            mm.close()
        return True


def execute(
    plan: ReadPlan,
    directory: str | os.PathLike,
    *,
    options: ExecOptions | None = None,
    stats: LoadStats | None = None,
    checksum: Checksum | None = None,
    source: RangeSource | None = None,
) -> LoadStats:
    """Run ``plan`` against the data files of ``directory``; returns (and fills) ``stats``.

    ``checksum``: the function of the checkpoint's recorded checksums (``CheckpointIndex.checksum``);
    items are then checked as described in the module docstring. None: nothing is checked.
    ``source``: where the data files' bytes come from when they are not on disk yet (a checkpoint
    on object storage, ckptd.format.reader.RangeSource): told every item's range in the order they
    are read, and asked for each before it is read."""
    stats = stats if stats is not None else LoadStats()
    opts = options or ExecOptions()
    with DataFiles(directory, source) as files:
        ex = _Executor(files, opts, stats, checksum)
        order = [plan.items[key] for key in sorted(plan.items)]
        files.prefetch([(e.item.relative_path, e.item.file_offset, e.item.length) for e in order])
        try:
            for entry in order:
                try:
                    ex.run_item(entry)
                except OSError as exc:
                    fd = files.fileno_and_size(entry.item.relative_path)[0]
                    raise read_error(exc, ex.item_what(entry), fd) from exc
        finally:
            if ex.helper is not None:
                ex.helper.shutdown(wait=True)
    log.debug("load executed: %s", stats)
    return stats


__all__ = ["execute", "ExecOptions", "LoadStats", "byte_view"]
