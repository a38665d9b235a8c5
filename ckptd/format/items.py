"""Serializing items the way torch DCP's FileSystemWriter does, and writing a rank's data file.

Each tensor item is a ``torch.save`` stream of exactly the chunk's bytes; each ShardedObject item
is ``torch.save([obj])`` (Megatron-Core's torch_dist convention). Items are concatenated in the
rank's ``__<rank>_0.distcp`` and located by ``(offset, length)`` in ``.metadata``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..mapping import ShardedObject, ShardedTensor
from .durable import Opener, default_opener
from .records import ItemRecord, object_record, storage_layout, tensor_record


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements.

    ``torch.save`` serializes a tensor's whole storage: saving a slice of a larger buffer would
    write the entire buffer. Contiguous views get a zero-copy storage slice; others are copied.
    """
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        return t.contiguous()
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if storage.nbytes() == nbytes and t.storage_offset() == 0:
        return t
    start = t.storage_offset() * t.element_size()
    sliced = storage[start : start + nbytes]
    return torch.empty(0, dtype=t.dtype).set_(sliced, 0, t.shape, t.stride())


@dataclass
class PlannedItem:
    """A record plus the payload to write: a chunk-shaped tensor, or serialized object bytes."""

    record: ItemRecord
    payload: torch.Tensor | bytes


def serialize_object(data: Any) -> bytes:
    buf = io.BytesIO()
    torch.save([data], buf)
    return buf.getvalue()


def plan_tensor(sh: ShardedTensor, rank: int) -> PlannedItem:
    if sh.data is None:
        raise ValueError(f"ShardedTensor '{sh.key}' has no data to save")
    _, _, sizes = storage_layout(sh)
    return PlannedItem(tensor_record(sh, rank), sh.data.reshape(sizes))


def plan_object(sh: ShardedObject, rank: int) -> PlannedItem:
    return PlannedItem(object_record(sh, rank), serialize_object(sh.data))


def write_item(f: Any, payload: torch.Tensor | bytes) -> None:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        f.write(payload)
    else:
        torch.save(exact_storage(payload), f)


def write_data_file(
    directory: str | os.PathLike,
    file_name: str,
    items: list[PlannedItem],
    opener: Opener = default_opener,
    fsync: bool = True,
) -> list[ItemRecord]:
    """Write ``items`` into ``directory/file_name``, fsync it, and return the stored records."""
    path = os.path.join(directory, file_name)
    stored: list[ItemRecord] = []
    with opener(path, "wb") as f:
        for item in items:
            start = f.tell()
            write_item(f, item.payload)
            stored.append(item.record.stored_at(file_name, start, f.tell() - start))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return stored
