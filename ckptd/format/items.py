"""Serializing items the way torch DCP's FileSystemWriter does, and writing a rank's data file.

Each tensor item is a ``torch.save`` stream of exactly the chunk's bytes; each ShardedObject item
is ``torch.save([obj])`` (Megatron-Core's torch_dist convention). Items are concatenated in the
rank's ``__<rank>_0.distcp`` and located by ``(offset, length)`` in ``.metadata``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import ShardingError, StorageError
from .checksum import BLOCK_NBYTES, crc32c, crc32c_combine, pack_blocks
from .direct import DIRECT_MIN_NBYTES, buffer_address, open_data_file
from .durable import Opener
from .objectkey import looks_like_object_key
from .records import (
    ItemRecord,
    dtype_from_name,
    object_record,
    storage_layout,
    storage_pieces,
    tensor_record,
    tensor_records,
)
from .safefs import Dir, entry_path
from .tensorzip import RawTensor, fits, write_raw_tensor

if TYPE_CHECKING:
    import torch

    from ..mapping import ByteItem, ShardedObject, ShardedTensor

# torch, ckptd.mapping and ckptd.format.pickled (which import torch) are imported where a rank
# plans or serializes items: the node daemon writes its items (RawTensor, bytes) with this module
# and never imports torch (README: Daemon memory).


@dataclass
class PlannedItem:
    """A record plus the payload to write: a chunk-shaped tensor, or serialized object bytes. (The
    daemon writes views of its staging rings: a tensor's as a :class:`~ckptd.format.tensorzip.RawTensor`,
    an object's as a memoryview; see :func:`write_item`.)"""

    record: ItemRecord
    payload: torch.Tensor | bytes
    # A tensor whose version counter also counts writes to ``payload``, for a lazy snapshot's
    # fence: the DTensor a piece is a view of the local tensor of (an in-place operation on a
    # DTensor bumps its own counter, never its local tensor's). None: the payload's own counter.
    watch: torch.Tensor | None = None


def serialize_object(data: Any, what: str = "ShardedObject") -> bytes:
    """Megatron-Core's ShardedObject item: ``torch.save([data])`` (compacted, see .pickled)."""
    from .pickled import serialize_pickled

    return serialize_pickled(data, what, in_list=True)


def plan_tensor(sh: ShardedTensor, rank: int, path: tuple[str | int, ...] = ()) -> PlannedItem:
    """The single item of an N-D ShardedTensor (flattened shards: use :func:`plan_tensor_items`);
    ``path``: where a DCP-style state dict held it."""
    if sh.data is None:
        raise ValueError(f"ShardedTensor '{sh.key}' has no data to save")
    if sh.flattened_range is not None:
        raise ShardingError(
            f"ShardedTensor '{sh.key}' is flattened and may be stored as several items; plan it with plan_tensor_items"
        )
    _, _, sizes = storage_layout(sh)
    data = sh.data
    return PlannedItem(tensor_record(sh, rank, path), data if data.shape == sizes else data.reshape(sizes))


def plan_tensor_items(sh: ShardedTensor, rank: int, path: tuple[str | int, ...] = ()) -> list[PlannedItem]:
    """The items a ShardedTensor is stored as (one per :func:`storage_pieces` entry); ``path``:
    where a DCP-style state dict held it.

    Payloads are views of ``sh.data`` (no copy): a flattened shard's pieces are consecutive
    slices of its 1-D data, reshaped to each piece's box.
    """
    if sh.data is None:
        raise ValueError(f"ShardedTensor '{sh.key}' has no data to save")
    if sh.flattened_range is None:
        return [plan_tensor(sh, rank, path)]
    flat = sh.data.reshape(-1)
    return [
        PlannedItem(
            replace(record, path=path) if path else record,
            flat[start : start + math.prod(record.sizes)].reshape(record.sizes),
        )
        for record, (_, _, _, start) in zip(tensor_records(sh, rank), storage_pieces(sh))
    ]


def piece_starts(sh: ShardedTensor) -> tuple[int, ...]:
    """First element in ``sh.data`` of each stored item (see :func:`storage_pieces`)."""
    if sh.flattened_range is None:
        return (0,)
    return tuple(start for _, _, _, start in storage_pieces(sh))


def tensor_payloads(
    sh: ShardedTensor, records: tuple[ItemRecord, ...] | list[ItemRecord], starts: tuple[int, ...]
) -> list[torch.Tensor]:
    """The payload views of ``sh``'s items, for records planned before (plan_save's cache)."""
    data = sh.data
    if data is None:
        raise ValueError(f"ShardedTensor '{sh.key}' has no data to save")
    if sh.flattened_range is None:
        return [data if data.shape == r.sizes else data.reshape(r.sizes) for r in records]
    flat = data.reshape(-1)
    return [flat[s : s + math.prod(r.sizes)].reshape(r.sizes) for r, s in zip(records, starts)]


def plan_object(sh: ShardedObject, rank: int) -> PlannedItem:
    what = f"ShardedObject '{sh.unique_key}' (rank {rank})"
    return PlannedItem(object_record(sh, rank), serialize_object(sh.data, what))


def plan_bytes(item: ByteItem, rank: int, path: tuple[str | int, ...] = ()) -> PlannedItem:
    """A DCP bytes item: ``torch.save(value)`` (not in a list, unlike a ShardedObject)."""
    from .pickled import serialize_pickled

    if path == (item.key,) and looks_like_object_key(item.key):
        raise ShardingError(
            f"the value '{item.key}' (rank {rank}) has the form of a ShardedObject's key "
            "(<key>/shard_<offsets>_<shape>): read back, it would be taken for one and not found; "
            "rename it, or nest it in a dict"
        )
    what = f"the value '{item.key}' (rank {rank})"
    return PlannedItem(object_record(item, rank, path), serialize_pickled(item.data, what))


# Writes at least this large are checksummed on the helper thread while the file write runs.
_OVERLAP_MIN_BYTES = 1 << 20


class ItemSink:
    """The stream each item is serialized into: places it in the file and checksums its bytes.

    ``torch.save`` streams an item through :meth:`write` (small zip headers, then the raw storage
    as one buffer, then the zip trailer). Call :meth:`begin` before and :meth:`end` after each item;
    ``end`` returns where the item landed and the CRC-32C of exactly its bytes (``None`` without
    checksums), computed as they are written, without reading the file back.

    On a file with an ``O_DIRECT`` path (:class:`~ckptd.format.direct.DirectFile`), an item's
    headers are held back until its first large buffer arrives; the item then starts after a
    few zero bytes chosen so that the buffer's address and its file offset agree modulo the
    direct-I/O alignment, and the bulk of it bypasses the page cache. Readers locate items by
    ``(offset, length)`` from ``.metadata``, so the gaps are invisible to them (torch DCP and
    Megatron-Core included).

    With a ``crc_executor`` (one worker), large buffers are checksummed on it while this thread
    writes them: the CRC-32C and the file write both release the GIL.
    """

    def __init__(self, f: Any, checksums: bool, crc_executor: Executor | None = None) -> None:
        self._f = f
        self._checksums = checksums
        self._executor = crc_executor
        self._align = int(getattr(f, "direct_alignment", 0) or 0)
        self._blocks: list[int] = []  # CRC-32Cs of the item's full blocks so far
        self._block_crc = 0  # of the block being written
        self._block_nbytes = 0
        self._start = -1
        self._held: bytearray | None = None

    def begin(self) -> None:
        self._blocks = []
        self._block_crc = self._block_nbytes = 0
        self._start = -1
        self._held = bytearray() if self._align else None
        if self._held is None:
            self._start = self._f.tell()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._held is not None:
            if view.nbytes < DIRECT_MIN_NBYTES:
                self._held += view
                self._fold(view)
                return view.nbytes
            self._place(buffer_address(view))
        if self._checksums and self._executor is not None and view.nbytes >= _OVERLAP_MIN_BYTES:
            # ``view`` (often the staging ring or the tensor's storage) stays valid until we return.
            pending = self._executor.submit(self._fold, view)
            try:
                self._f.write(view)
            finally:
                pending.result()
        else:
            self._f.write(view)
            self._fold(view)
        return view.nbytes

    def _fold(self, view: memoryview) -> None:
        """Checksum the item's next bytes, block by block (see ckptd.format.checksum)."""
        if not self._checksums:
            return
        pos, n = 0, view.nbytes
        while pos < n:
            take = min(n - pos, BLOCK_NBYTES - self._block_nbytes)
            self._block_crc = crc32c(view[pos : pos + take], self._block_crc)
            self._block_nbytes += take
            pos += take
            if self._block_nbytes == BLOCK_NBYTES:
                self._blocks.append(self._block_crc)
                self._block_crc = self._block_nbytes = 0

    def _place(self, address: int) -> None:
        """Start the held-back item where ``address`` lands aligned, and write its headers."""
        held, self._held = self._held or bytearray(), None
        pos = self._f.tell()
        start = pos + (address - pos - len(held)) % self._align
        if start != pos:
            self._f.skip_to(start)
        self._start = start
        self._f.write(held)

    def flush(self) -> None:
        """Called by torch.save after each item; the file is flushed once, at its end."""

    def end(self) -> tuple[int, int, int | None, bytes]:
        """``(offset, length, CRC-32C, block CRC-32Cs)`` of the item written since :meth:`begin`
        (no block checksums for an item of one block, or without checksums)."""
        if self._held is not None:
            held, self._held = self._held, None
            self._start = self._f.tell()
            self._f.write(held)
        length = self._f.tell() - self._start
        if not self._checksums:
            return self._start, length, None, b""
        blocks = self._blocks + ([self._block_crc] if self._block_nbytes or not self._blocks else [])
        crc = blocks[0]
        for i, block_crc in enumerate(blocks[1:], 1):
            crc = crc32c_combine(crc, block_crc, min(BLOCK_NBYTES, length - i * BLOCK_NBYTES))
        return self._start, length, crc, pack_blocks(blocks) if len(blocks) > 1 else b""


def payload_crc(payload: Any) -> int:
    """CRC-32C of a payload's values: a value's bytes, or a tensor's elements as stored
    (contiguous, conjugate and negative bits resolved, on the CPU)."""
    import torch

    if not isinstance(payload, torch.Tensor):
        return crc32c(payload)
    t = payload.detach().resolve_conj().resolve_neg().contiguous().cpu()
    n = t.numel() * t.element_size()
    return crc32c(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else b"")


@contextlib.contextmanager
def _zip_crc32_omitted(omit: bool) -> Iterator[None]:
    """While active, ``torch.save`` *in this thread* writes its zip entries without a CRC-32.

    torch computes a CRC-32 of every record it writes: a second pass over every tensor byte
    besides ckptd's own per-item CRC-32 (:class:`ItemSink`), ~11 ms per 64 MiB item, serial with
    the file write. Omitted only where ckptd's checksums are on, so every byte stays covered by
    one checksum; torch.load, torch DCP and Megatron-Core do not check zip CRCs (torch itself
    writes them as 0 under this setting) and ``ckptd verify`` checks ckptd's. torch keeps the
    setting in a context variable, i.e. per thread: it must be set on the thread that saves
    (the daemon's writer threads), and it does not leak into the caller's other threads.
    """
    if not omit:
        yield
        return
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def write_item(f: Any, payload: torch.Tensor | RawTensor | bytes | memoryview, zip_crc32: bool = True) -> None:
    """One item into ``f``: bytes as they are; a tensor as ``torch.save`` writes it, with zip
    CRC-32s or, with ``zip_crc32`` False, zeros where torch writes them (:func:`_zip_crc32_omitted`).
    torch is imported only for a tensor ckptd's own writer does not write (ckptd.format.tensorzip)."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        f.write(payload)
        return
    if isinstance(payload, RawTensor) and fits(payload):
        write_raw_tensor(f, payload, zip_crc32)  # the same bytes, without torch
        return
    import torch

    from .pickled import exact_storage

    with _zip_crc32_omitted(not zip_crc32):
        if isinstance(payload, RawTensor):  # too large for ckptd's writer (zip64)
            torch.save(_raw_as_tensor(payload), f)
        else:
            # Plain data, as DCP writes it: no requires_grad flag or autograd history in the item.
            torch.save(exact_storage(payload.detach()), f)


def _raw_as_tensor(raw: RawTensor) -> torch.Tensor:
    """A tensor over ``raw``'s bytes (no copy): for the items torch.save still writes."""
    import torch

    dtype = dtype_from_name(raw.dtype)
    if not memoryview(raw.data).nbytes:
        return torch.empty(raw.shape, dtype=dtype)
    return torch.frombuffer(raw.data, dtype=torch.uint8).view(dtype).view(raw.shape)


# The bytes an item's archive adds to its payload's, at most (generously: measured 1.6-1.9 KiB
# for a tensor of up to 64 dimensions; an object's item is its payload alone).
ITEM_OVERHEAD_MAX_NBYTES = 16 << 10


def data_file_max_nbytes(items: list[PlannedItem]) -> int:
    """A bound of the size of the data file :func:`write_data_file` writes of ``items`` (an
    upload's parts are sized by it: ckptd.storage.objwriter)."""
    total = 0
    for item in items:
        payload: Any = item.payload
        if isinstance(payload, RawTensor):
            nbytes = memoryview(payload.data).nbytes
        elif isinstance(payload, (bytes, bytearray, memoryview)):
            nbytes = memoryview(payload).nbytes
        else:  # a tensor (not imported here: the daemon never imports torch)
            nbytes = payload.numel() * payload.element_size()
            if payload.is_quantized:  # a per-channel one's scales and zero points: 16 bytes a channel
                nbytes += 16 * sum(payload.shape)
        total += nbytes + ITEM_OVERHEAD_MAX_NBYTES
    return total


def write_data_file(
    directory: Dir | str | os.PathLike,
    file_name: str,
    items: list[PlannedItem],
    opener: Opener = open_data_file,
    fsync: bool = True,
    checksums: bool = True,
    ready: Callable[[int], None] | None = None,
    written: Callable[[int], None] | None = None,
) -> list[ItemRecord]:
    """Write ``items`` into ``directory/file_name``, fsync it, and return the stored records.

    With ``checksums`` each record carries the CRC-32C of its item's bytes (``ItemRecord.crc``),
    computed as the bytes are written (see :class:`ItemSink`); ``ckptd verify`` checks them.
    ``ready(i)`` is called before item ``i`` is written and returns once its payload is complete
    (the daemon: a snapshot child may still be copying later items); ``written(i)`` after it was
    handed to the file (its payload may be overwritten from then on: the daemon frees ring space).
    """
    if checksums:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-crc32c") as executor:
            return _write_data_file(directory, file_name, items, opener, fsync, checksums, executor, ready, written)
    return _write_data_file(directory, file_name, items, opener, fsync, checksums, None, ready, written)


def _write_data_file(
    directory: Dir | str | os.PathLike,
    file_name: str,
    items: list[PlannedItem],
    opener: Opener,
    fsync: bool,
    checksums: bool,
    crc_executor: Executor | None,
    ready: Callable[[int], None] | None,
    written: Callable[[int], None] | None,
) -> list[ItemRecord]:
    path = entry_path(directory, file_name)  # in an open Dir: created relative to its fd
    stored: list[ItemRecord] = []
    with opener(path, "wb") as raw:
        keeper = _OSErrorKeeper(raw)
        sink = ItemSink(keeper, checksums, crc_executor)
        writeback = _Writeback(raw) if fsync else None
        for i, item in enumerate(items):
            if ready is not None:
                ready(i)
            sink.begin()
            try:
                write_item(sink, item.payload, zip_crc32=not checksums)
                start, length, crc, blocks = sink.end()
            except RuntimeError:
                # torch.save reports a failed write of its stream as "RuntimeError: [enforce fail
                # at inline_container.cc] unexpected pos"; the OSError (disk full...) is the news.
                if keeper.error is not None:
                    raise keeper.error from None
                raise
            stored.append(item.record.stored_at(file_name, start, length, crc, blocks))
            if writeback is not None:
                writeback.written(start + length)
            if written is not None:
                written(i)
        raw.flush()
        if fsync:
            os.fsync(raw.fileno())
    return stored


def libc_sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
# Start the writeback of a data file every this many bytes written.
WRITEBACK_NBYTES = 32 << 20


class _Writeback:
    """Starts the kernel's writeback of a data file while the rest of it is still being written.

    Without it, a file's pages stay dirty in the page cache until the final fsync, which then
    waits for all of them (write, then flush: one after the other), and a large file may hit the
    kernel's dirty-page throttling on the way. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` every
    :data:`WRITEBACK_NBYTES` queues what was written so far for the disk and returns, so the disk
    works while the next items are written and the fsync finds little left to do. Durability
    still comes from that fsync; this only changes when the disk starts. Best effort: a file
    object without a real descriptor, or a system without the call, skips it.
    """

    def __init__(self, f: Any) -> None:
        self.fd = -1
        self.started = 0
        if _SYNC_FILE_RANGE is not None:
            try:
                self.fd = f.fileno()
            except (AttributeError, OSError, ValueError):
                pass

    def written(self, end: int) -> None:
        """The file's bytes up to ``end`` were handed to it (some may sit in its buffer still)."""
        if self.fd >= 0 and end - self.started >= WRITEBACK_NBYTES:
            _SYNC_FILE_RANGE(self.fd, self.started, end - self.started, _SYNC_FILE_RANGE_WRITE)
            self.started = end


class _OSErrorKeeper:
    """Write-through wrapper remembering the first storage error a write raised (an OSError of a
    file, a StorageError of an object upload; see _write_data_file)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | StorageError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except (OSError, StorageError) as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def largest_object(items: list[PlannedItem]) -> PlannedItem | None:
    """The largest item that is not a tensor (a plain value's or a ShardedObject's bytes, which
    :func:`split_large_items` cannot split), or None: a staging ring must hold it whole."""
    import torch

    objects = [i for i in items if not isinstance(i.payload, torch.Tensor)]
    return max(objects, key=lambda i: len(i.payload), default=None)


def split_large_items(items: list[PlannedItem], max_nbytes: int) -> list[PlannedItem]:
    """``items`` with every tensor item larger than ``max_nbytes`` stored as several chunks.

    A staging ring smaller than one item cannot hold it whole (ckptd.staging.ring), so such an
    item is stored as the N-D boxes of consecutive flat ranges of ``max_nbytes // 2`` bytes (half,
    so that the daemon writes one while the next is copied): more chunks of the same tensor,
    which torch DCP, Megatron-Core and ckptd load like any other chunking. Objects cannot be
    split: one larger than ``max_nbytes`` raises StagingError (a Checkpointer makes its ring hold
    the largest one first: ckptd.client.rankring).
    """
    import torch

    from ..errors import StagingError
    from .geometry import flat_range_boxes

    out: list[PlannedItem] = []
    for item in items:
        payload = item.payload
        if not isinstance(payload, torch.Tensor):
            if len(payload) > max_nbytes:
                raise StagingError(
                    f"{item.record.where()} takes {len(payload)} bytes, more than the staging "
                    f"ring's {max_nbytes}, and an object cannot be split"
                )
            out.append(item)
            continue
        nbytes = payload.numel() * payload.element_size()
        if nbytes <= max_nbytes:
            out.append(item)
            continue
        rec = item.record
        t = payload.detach().resolve_conj().resolve_neg()
        # Views of the tensor: its pieces share its version counter, so a lazy snapshot sees a
        # write to it before the fence (a storage slice, as exact_storage makes of a slice of a
        # larger buffer, has a counter of its own: the write went unseen and the save committed
        # torn). A CUDA tensor stays on its device: its pieces are copied into pinned ring chunks
        # like any CUDA item (DMA, or a device snapshot), never by a synchronous pageable copy of
        # the whole tensor inside save(). A strided one becomes contiguous here first (a copy
        # taken now: what save() was called with).
        flat = t.contiguous().reshape(-1)
        # A copy (of a strided or conjugate tensor) holds the values of save(): a later write to
        # the source, even through its DTensor, no longer reaches the pieces.
        copied = flat.untyped_storage().data_ptr() != payload.untyped_storage().data_ptr()
        watch = None if copied else item.watch
        step = max(1, (max_nbytes // 2) // payload.element_size())
        for a in range(0, flat.numel(), step):
            b = min(flat.numel(), a + step)
            for off, sizes, start in flat_range_boxes(tuple(rec.sizes), a, b):
                n = math.prod(sizes)
                box = replace(rec, offsets=tuple(o + d for o, d in zip(rec.offsets, off)), sizes=tuple(sizes))
                out.append(replace(item, record=box, payload=flat[start : start + n].reshape(sizes), watch=watch))
    return out
