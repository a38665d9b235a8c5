"""Serializing items the way torch DCP's FileSystemWriter does, and writing a rank's data file.

Each tensor item is a ``torch.save`` stream of exactly the chunk's bytes; each ShardedObject item
is ``torch.save([obj])`` (Megatron-Core's torch_dist convention). Items are concatenated in the
rank's ``__<rank>_0.distcp`` and located by ``(offset, length)`` in ``.metadata``.
"""

from __future__ import annotations

import ctypes
import math
import os
import zlib
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ShardingError
from ..mapping import ShardedObject, ShardedTensor
from .durable import Opener, default_opener
from .pickled import exact_storage, serialize_pickled
from .records import (
    ItemRecord,
    object_record,
    storage_layout,
    storage_pieces,
    tensor_record,
    tensor_records,
)


@dataclass
class PlannedItem:
    """A record plus the payload to write: a chunk-shaped tensor, or serialized object bytes."""

    record: ItemRecord
    payload: torch.Tensor | bytes


def serialize_object(data: Any, what: str = "ShardedObject") -> bytes:
    """Megatron-Core's ShardedObject item: ``torch.save([data])`` (compacted, see .pickled)."""
    return serialize_pickled(data, what, in_list=True)


def plan_tensor(sh: ShardedTensor, rank: int) -> PlannedItem:
    """The single item of an N-D ShardedTensor (flattened shards: use :func:`plan_tensor_items`)."""
    if sh.data is None:
        raise ValueError(f"ShardedTensor '{sh.key}' has no data to save")
    if sh.flattened_range is not None:
        raise ShardingError(
            f"ShardedTensor '{sh.key}' is flattened and may be stored as several items; "
            "plan it with plan_tensor_items"
        )
    _, _, sizes = storage_layout(sh)
    data = sh.data
    return PlannedItem(tensor_record(sh, rank), data if data.shape == sizes else data.reshape(sizes))


def plan_tensor_items(sh: ShardedTensor, rank: int) -> list[PlannedItem]:
    """The items a ShardedTensor is stored as (one per :func:`storage_pieces` entry).

    Payloads are views of ``sh.data`` (no copy): a flattened shard's pieces are consecutive
    slices of its 1-D data, reshaped to each piece's box.
    """
    if sh.data is None:
        raise ValueError(f"ShardedTensor '{sh.key}' has no data to save")
    if sh.flattened_range is None:
        return [plan_tensor(sh, rank)]
    flat = sh.data.reshape(-1)
    return [
        PlannedItem(record, flat[start : start + math.prod(record.sizes)].reshape(record.sizes))
        for record, (_, _, _, start) in zip(tensor_records(sh, rank), storage_pieces(sh))
    ]


def plan_object(sh: ShardedObject, rank: int) -> PlannedItem:
    what = f"ShardedObject '{sh.unique_key}' (rank {rank})"
    return PlannedItem(object_record(sh, rank), serialize_object(sh.data, what))


# Writes at least this large are checksummed on the helper thread while the file write runs.
_OVERLAP_MIN_BYTES = 1 << 20


class Crc32Writer:
    """A write-through file wrapper that folds every written byte into a running CRC-32.

    ``torch.save`` streams an item through ``write`` (small headers plus the raw storage as one
    memoryview), so the checksum is computed over exactly the bytes written, without reading the
    file back. :meth:`take` returns the CRC of everything written since the previous call (one
    item) and starts the next one. With an ``executor`` (one worker), large buffers are
    checksummed on it while this thread writes them: both ``zlib.crc32`` and the file write
    release the GIL, so the CRC (~2 GB/s) overlaps the I/O instead of adding to it.
    """

    def __init__(self, f: Any, executor: Executor | None = None) -> None:
        self._f = f
        self._crc = 0
        self._executor = executor

    def write(self, data: Any) -> int:
        if self._executor is not None and memoryview(data).nbytes >= _OVERLAP_MIN_BYTES:
            # ``data`` (often a view of the tensor's storage) stays valid until we return.
            pending = self._executor.submit(zlib.crc32, data, self._crc)
            try:
                n = self._f.write(data)
            finally:
                self._crc = pending.result()
            return n
        n = self._f.write(data)
        self._crc = zlib.crc32(data, self._crc)
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def take(self) -> int:
        crc, self._crc = self._crc, 0
        return crc


def write_item(f: Any, payload: torch.Tensor | bytes) -> None:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        f.write(payload)
    else:
        # Plain data, as DCP writes it: no requires_grad flag or autograd history in the item.
        torch.save(exact_storage(payload.detach()), f)


def write_data_file(
    directory: str | os.PathLike,
    file_name: str,
    items: list[PlannedItem],
    opener: Opener = default_opener,
    fsync: bool = True,
    checksums: bool = True,
) -> list[ItemRecord]:
    """Write ``items`` into ``directory/file_name``, fsync it, and return the stored records.

    With ``checksums`` each record carries the CRC-32 of its item's bytes (``ItemRecord.crc32``),
    computed as the bytes are written (see :class:`Crc32Writer`); ``ckptd verify`` checks them.
    """
    if checksums:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-crc32") as executor:
            return _write_data_file(directory, file_name, items, opener, fsync, executor)
    return _write_data_file(directory, file_name, items, opener, fsync, None)


def _write_data_file(
    directory: str | os.PathLike,
    file_name: str,
    items: list[PlannedItem],
    opener: Opener,
    fsync: bool,
    crc_executor: Executor | None,
) -> list[ItemRecord]:
    path = os.path.join(directory, file_name)
    stored: list[ItemRecord] = []
    with opener(path, "wb") as raw:
        keeper = _OSErrorKeeper(raw)
        f: Any = keeper if crc_executor is None else Crc32Writer(keeper, crc_executor)
        writeback = _Writeback(raw) if fsync else None
        for item in items:
            start = f.tell()
            try:
                write_item(f, item.payload)
            except RuntimeError:
                # torch.save reports a failed write of its stream as "RuntimeError: [enforce fail
                # at inline_container.cc] unexpected pos"; the OSError (disk full...) is the news.
                if keeper.error is not None:
                    raise keeper.error from None
                raise
            end = f.tell()
            crc = f.take() if isinstance(f, Crc32Writer) else None
            stored.append(item.record.stored_at(file_name, start, end - start, crc))
            if writeback is not None:
                writeback.written(end)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return stored


def _sync_file_range() -> Any:
    """libc's ``sync_file_range`` (Linux), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()
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
    """Write-through wrapper remembering the first OSError a write raised (see _write_data_file)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()
