"""The DCP ``.metadata`` file: built from item records, read back with a restricted unpickler.

torch DCP stores ``.metadata`` as a pickled ``Metadata``; to stay readable by DCP and
Megatron-Core ckptd writes the same object. Reading uses an allow-list unpickler, so a hostile
``.metadata`` cannot run code unless the caller explicitly allows unsafe pickles.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafePickleError
from .durable import Opener, atomic_write, default_opener
from .layout import DCP_METADATA
from .records import BYTES, TENSOR, ItemRecord, dtype_from_name, dtype_name

DCP_VERSION = "1.0.0"

_ALLOWED_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    # Megatron-Core records every rank's save plan in `all_local_plans`.
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _ALLOWED_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafePickleError(
            f"{DCP_METADATA} references {module}.{name}, which is not part of the DCP metadata "
            "format; refusing to unpickle it. If you trust this checkpoint, pass "
            "allow_unsafe_pickle=True."
        )


@dataclass
class StoredChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str
    file_offset: int
    length: int


@dataclass
class StoredTensor:
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[StoredChunk] = field(default_factory=list)


@dataclass
class StoredObject:
    fqn: str
    relative_path: str
    file_offset: int
    length: int


@dataclass
class CheckpointIndex:
    """What ``.metadata`` says, in ckptd's terms."""

    tensors: dict[str, StoredTensor]
    objects: dict[str, StoredObject]
    raw: Metadata


def build_metadata(records: list[ItemRecord], checkpoint_id: str | None = None) -> Metadata:
    """Turn all ranks' stored records into the DCP Metadata (chunk lists in offset order)."""
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    chunks: dict[str, list[ItemRecord]] = defaultdict(list)
    for r in records:
        if r.kind == TENSOR:
            chunks[r.fqn].append(r)
        else:
            state[r.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(r.fqn)] = _StorageInfo(r.relative_path, r.file_offset, r.length)
    for fqn, items in chunks.items():
        items.sort(key=lambda r: r.offsets)
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(items[0].dtype)),
            size=torch.Size(items[0].global_shape),
            chunks=[ChunkStorageMetadata(torch.Size(r.offsets), torch.Size(r.sizes)) for r in items],
        )
        for i, r in enumerate(items):
            storage[MetadataIndex(fqn, r.offsets, i)] = _StorageInfo(
                r.relative_path, r.file_offset, r.length
            )
    return Metadata(
        state_dict_metadata=dict(sorted(state.items())),
        planner_data={fqn: (fqn,) for fqn in sorted(state)},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id),
        version=DCP_VERSION,
    )


def write_metadata(directory: str | os.PathLike, metadata: Metadata,
                   opener: Opener = default_opener, fsync: bool = True) -> None:
    atomic_write(Path(directory) / DCP_METADATA, lambda f: pickle.dump(metadata, f), opener, fsync)


def read_index(directory: str | os.PathLike, allow_unsafe_pickle: bool = False) -> CheckpointIndex:
    """Read ``.metadata`` and index its tensors and objects."""
    path = Path(directory) / DCP_METADATA
    try:
        raw_bytes = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path} is missing: {directory} has no DCP metadata, so it is not a complete "
            "checkpoint (an interrupted save leaves no .metadata). Load an earlier checkpoint."
        ) from None
    try:
        if allow_unsafe_pickle:
            md = pickle.loads(raw_bytes)
        else:
            md = _MetadataUnpickler(io.BytesIO(raw_bytes)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{path} cannot be decoded ({exc!r}); the file is damaged") from exc
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpointError(f"{path} does not hold a DCP Metadata object")
    return index_metadata(md, path)


def index_metadata(md: Metadata, where: Path | str = DCP_METADATA) -> CheckpointIndex:
    storage = md.storage_data or {}
    by_fqn: dict[str, dict[tuple[int, ...] | None, _StorageInfo]] = defaultdict(dict)
    for idx, info in storage.items():
        by_fqn[idx.fqn][tuple(idx.offset) if idx.offset is not None else None] = info
    tensors: dict[str, StoredTensor] = {}
    objects: dict[str, StoredObject] = {}
    for fqn, entry in md.state_dict_metadata.items():
        infos = by_fqn.get(fqn, {})
        if isinstance(entry, TensorStorageMetadata):
            st = StoredTensor(fqn, entry.properties.dtype, tuple(entry.size))
            for ch in entry.chunks:
                info = infos.get(tuple(ch.offsets))
                if info is None:
                    raise CorruptCheckpointError(
                        f"{where}: tensor '{fqn}' chunk at {tuple(ch.offsets)} has no storage entry"
                    )
                if getattr(info, "transform_descriptors", None):
                    raise CorruptCheckpointError(
                        f"{where}: tensor '{fqn}' uses storage transforms "
                        f"{info.transform_descriptors}, which ckptd does not read"
                    )
                st.chunks.append(StoredChunk(tuple(ch.offsets), tuple(ch.sizes),
                                             info.relative_path, info.offset, info.length))
            tensors[fqn] = st
        elif isinstance(entry, BytesStorageMetadata):
            info = infos.get(None)
            if info is None:
                raise CorruptCheckpointError(f"{where}: object '{fqn}' has no storage entry")
            objects[fqn] = StoredObject(fqn, info.relative_path, info.offset, info.length)
    return CheckpointIndex(tensors, objects, md)


def records_from_index(index: CheckpointIndex) -> list[ItemRecord]:
    """The stored records of an existing checkpoint (rank is unknown: -1)."""
    out = [
        ItemRecord(t.fqn, TENSOR, -1, dtype_name(t.dtype), t.shape, c.offsets, c.sizes,
                   c.relative_path, c.file_offset, c.length)
        for t in index.tensors.values()
        for c in t.chunks
    ]
    out += [ItemRecord(o.fqn, BYTES, -1, relative_path=o.relative_path, file_offset=o.file_offset,
                       length=o.length) for o in index.objects.values()]
    return out
