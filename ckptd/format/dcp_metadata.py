"""The DCP ``.metadata`` file: built from item records, read back with a restricted unpickler.

torch DCP stores ``.metadata`` as a pickled ``Metadata``; to stay readable by DCP and
Megatron-Core ckptd writes the same object. Reading uses an allow-list unpickler
(:mod:`ckptd.format.metadata_unpickler`), so a hostile ``.metadata`` cannot run code unless the
caller explicitly allows unsafe pickles.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .checksum import BLOCK_NBYTES, TABLE_VERSION, Checksum, block_count, checksum_for
from .dcp_pickle import CHECKSUMS_ATTR, metadata_pickle
from .durable import Opener, atomic_write, default_opener
from .layout import COMMON_PT, DATA_FILE_PATTERN, DCP_METADATA, DCP_METADATA_MAX_NBYTES, METADATA_JSON
from .metadata_unpickler import unpickle_metadata
from .objectkey import looks_like_object_key
from .records import BYTES, TENSOR, ItemRecord, dtype_name
from .safefs import Dir, entry_exists, entry_path, read_regular

log = logging.getLogger(__name__)

# Extra attribute of the pickled DCP ``Metadata`` holding ckptd's checksums. torch DCP and
# Megatron-Core unpickle the object and ignore attributes they do not know, and keeping the
# checksums in ``.metadata`` binds them atomically to the offsets they describe (one file, one
# rename). Value: {"version": 2, "algorithm": "crc32c",
#                  "items": {(fqn, offsets): crc}  (offsets () for byte items),
#                  "files": {"common.pt": crc},
#                  "block_nbytes": 4 MiB, "blocks": {(fqn, offsets): packed block crcs}}.
# Version 1 tables (older ckptd) hold zlib CRC-32s (ckptd.format.checksum). Tables without
# "block_nbytes" (ckptd before block checksums) check an item read in part only by reading all of it.


@dataclass
class StoredChunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    relative_path: str
    file_offset: int
    length: int
    crc: int | None = None  # recorded at save time by ckptd; None for other writers
    block_crcs: bytes = b""  # the blocks' checksums (ckptd.format.checksum), for items over one block


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
    crc: int | None = None
    # A ShardedObject shard (torch.save([obj])) rather than a DCP value (torch.save(value)).
    sharded_object: bool = False


@dataclass
class CheckpointIndex:
    """What ``.metadata`` says, in ckptd's terms."""

    tensors: dict[str, StoredTensor]
    objects: dict[str, StoredObject]
    raw: Metadata
    # The checksum of common.pt, when ckptd recorded it; it and the chunks' ``crc`` are CRC-32C or,
    # in tables of older ckptd, zlib CRC-32: ``checksum`` computes them (ckptd.format.checksum).
    common_crc: int | None = None
    checksum: Checksum | None = None
    # The block size of the items' block checksums; 0 when the table has none (older ckptd, or
    # checksums not recorded): then an item read in part is checked only by reading all of it.
    block_nbytes: int = 0

    @property
    def has_checksums(self) -> bool:
        return hasattr(self.raw, CHECKSUMS_ATTR)


def build_metadata(
    records: list[ItemRecord], checkpoint_id: str | None = None, common_crc: int | None = None
) -> Metadata:
    """Turn all ranks' stored records into the DCP Metadata (chunk lists in offset order): the
    object ``.metadata`` holds (:func:`ckptd.format.dcp_pickle.metadata_pickle` writes its bytes).

    Item checksums (``ItemRecord.crc``) and ``common_crc`` are kept in the extra attribute
    :data:`CHECKSUMS_ATTR`, which DCP and Megatron-Core ignore.
    """
    md = pickle.loads(metadata_pickle(records, checkpoint_id, common_crc))
    if not isinstance(md, Metadata):
        raise TypeError(f"the metadata pickle gave a {type(md).__name__}")  # cannot happen
    return md


@dataclass(frozen=True)
class _Table:
    """What :data:`CHECKSUMS_ATTR` holds, checked."""

    items: dict[tuple[str, tuple[int, ...]], int] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    checksum: Checksum | None = None
    block_nbytes: int = 0
    blocks: dict[tuple[str, tuple[int, ...]], bytes] = field(default_factory=dict)


def _checksums(md: Metadata, where: Path | str) -> _Table:
    """The checksum table of :data:`CHECKSUMS_ATTR`; empty when not recorded."""
    raw = getattr(md, CHECKSUMS_ATTR, None)
    if raw is None:
        return _Table()
    version = raw.get("version") if isinstance(raw, dict) else None
    algorithm = raw.get("algorithm") if isinstance(raw, dict) else None
    fn = checksum_for(version, algorithm)
    if fn is None:
        if type(version) is int and version > TABLE_VERSION:
            # A newer ckptd's table: the checkpoint still loads, without checksums. Refusing it
            # would make a resume after a downgrade skip every newer checkpoint, and the next
            # commit leave them on an abandoned branch for retention to remove.
            log.warning(
                "%s: checksum table of version %d, newer than this ckptd's %d: loaded without checksums; "
                "`ckptd verify` of a ckptd that knows it checks them",
                where,
                version,
                TABLE_VERSION,
            )
            return _Table()
        # Any other pair this ckptd does not know (a version it knows with another algorithm, a
        # version that is no int) is a flipped bit: loaded without checksums, bit rot would pass.
        raise CorruptCheckpointError(
            f"{where}: the checksum table ({CHECKSUMS_ATTR}) names version {str(version)[:40]!r} / algorithm "
            f"{str(algorithm)[:40]!r}, which no ckptd writes; the file is damaged. Load an earlier checkpoint."
        )
    try:
        items = {(str(k[0]), tuple(int(x) for x in k[1])): int(v) for k, v in raw["items"].items()}
        files = {str(k): int(v) for k, v in raw.get("files", {}).items()}
        block_nbytes = int(raw.get("block_nbytes", 0))
        blocks = {(str(k[0]), tuple(int(x) for x in k[1])): v for k, v in raw.get("blocks", {}).items()}
        if block_nbytes < 0 or (blocks and not block_nbytes):
            raise ValueError(f"block size {block_nbytes}")
        if not all(type(v) is bytes for v in blocks.values()):
            raise TypeError("block checksums that are not bytes")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise CorruptCheckpointError(
            f"{where}: the checksum table ({CHECKSUMS_ATTR}) is malformed ({exc!r}); the file is "
            "damaged. Load an earlier checkpoint."
        ) from exc
    return _Table(items, files, fn, block_nbytes, blocks)


def write_metadata(
    directory: Dir | str | os.PathLike, metadata: Metadata, opener: Opener = default_opener, fsync: bool = True
) -> None:
    atomic_write(entry_path(directory, DCP_METADATA), lambda f: pickle.dump(metadata, f), opener, fsync)


def read_index(directory: str | os.PathLike, allow_unsafe_pickle: bool = False) -> CheckpointIndex:
    """Read ``.metadata`` (a regular file inside ``directory``, see ckptd.format.safefs) and index
    its tensors and objects; anything malformed is a CorruptCheckpointError naming the file."""
    path = Path(directory) / DCP_METADATA
    try:
        raw_bytes = read_regular(directory, DCP_METADATA, "DCP metadata", DCP_METADATA_MAX_NBYTES)
    except FileNotFoundError:
        if entry_exists(directory, METADATA_JSON):
            # metadata.json is written after .metadata: the checkpoint was complete once.
            raise CorruptCheckpointError(
                f"{path} is missing although {METADATA_JSON} marks {directory} as a complete "
                "checkpoint; the chunk index is lost. Restore the file, or load an earlier "
                "checkpoint."
            ) from None
        raise CheckpointNotFoundError(
            f"{path} is missing: {directory} has no DCP metadata, so it is not a complete "
            "checkpoint (an interrupted save leaves no .metadata). Load an earlier checkpoint."
        ) from None
    try:
        md = unpickle_metadata(raw_bytes, allow_unsafe_pickle, path)
    except UnsafePickleError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{path} cannot be decoded ({exc!r}); the file is damaged") from exc
    # getattr: a damaged pickle may BUILD a Metadata under another attribute name
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path} does not hold a DCP Metadata object")
    try:
        return index_metadata(md, path, pickle_nbytes=len(raw_bytes))
    except CkptdError:
        raise
    except Exception as exc:  # a well-formed pickle of ill-formed values (types, nesting)
        raise CorruptCheckpointError(
            f"{path}: the chunk index is malformed ({exc!r}); the file is damaged. Load an earlier checkpoint."
        ) from exc


def _ints(value: Any, where: Path | str, what: str) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints (offsets, sizes, shapes), else an error naming it."""
    out = tuple(value) if isinstance(value, (tuple, list)) else None
    if out is None or not all(type(v) is int and v >= 0 for v in out):
        raise CorruptCheckpointError(
            f"{where}: {what} is {value!r:.200}, not a tuple of non-negative integers; the file is damaged"
        )
    return out


def _location(info: Any, where: Path | str, what: str) -> tuple[str, int, int]:
    """``(relative_path, offset, length)`` of a storage entry, with their types checked."""
    rel, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    if not isinstance(rel, str) or type(offset) is not int or type(length) is not int:
        raise CorruptCheckpointError(
            f"{where}: the storage entry of {what} is malformed ({info!r:.200}); the file is damaged"
        )
    return rel, offset, length


def _refuse_transforms(where: Path | str, what: str, info: _StorageInfo) -> None:
    """A stream transform (torch DCP's ``_extensions``: ZStandard compression, or one of the
    user's own) makes an item's bytes something ckptd cannot read. The checkpoint is not damaged:
    torch DCP loads it with the extension available."""
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise UnsupportedFormatError(
            f"{where}: {what} is stored with the stream transform(s) {list(transforms)} (torch DCP's "
            "FileSystemWriter(_extensions=...), e.g. ZStandard compression), which ckptd does not "
            "read. Load it with torch.distributed.checkpoint.load, or save it again without "
            "_extensions to use it with ckptd."
        )


# A chunk's entries take over 100 bytes of a .metadata (its chunk, index and storage records); a
# pickle can repeat one by reference in 2 bytes, and each became a record of some 600 bytes here.
_MIN_PICKLE_NBYTES_PER_CHUNK = 16


def index_metadata(
    md: Metadata, where: Path | str = DCP_METADATA, *, pickle_nbytes: int | None = None
) -> CheckpointIndex:
    """The checkpoint ``md`` describes; ``pickle_nbytes``, the size of the file it was read from,
    bounds how many chunks it may list (CorruptCheckpointError beyond, before any is indexed)."""
    if pickle_nbytes is not None:
        chunks = sum(
            len(e.chunks) if isinstance(e, TensorStorageMetadata) else 1 for e in md.state_dict_metadata.values()
        )
        if chunks > pickle_nbytes // _MIN_PICKLE_NBYTES_PER_CHUNK:
            raise CorruptCheckpointError(
                f"{where}: lists {chunks} chunks in {pickle_nbytes} bytes, which cannot hold so many (each takes "
                "over 100 bytes of a real .metadata); the file is damaged or hostile. Load an earlier checkpoint."
            )
    table = _checksums(md, where)
    storage = md.storage_data or {}
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{where}: storage_data is a {type(storage).__name__}, not a dict")
    by_fqn: dict[str, dict[tuple[int, ...] | None, _StorageInfo]] = defaultdict(dict)
    for idx, info in storage.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(idx.fqn, str):
            raise CorruptCheckpointError(f"{where}: storage key {idx!r:.200} is not a MetadataIndex")
        chunk = None if idx.offset is None else _ints(idx.offset, where, f"the offset of '{idx.fqn}'")
        by_fqn[idx.fqn][chunk] = info
    tensors: dict[str, StoredTensor] = {}
    objects: dict[str, StoredObject] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise CorruptCheckpointError(f"{where}: key {fqn!r:.200} is not a string")
        infos = by_fqn.get(fqn, {})
        if isinstance(entry, TensorStorageMetadata):
            dtype = getattr(getattr(entry, "properties", None), "dtype", None)
            if not isinstance(dtype, torch.dtype) or not isinstance(entry.chunks, list):
                raise CorruptCheckpointError(f"{where}: tensor '{fqn}' has a malformed dtype or chunk list")
            shape = _ints(entry.size, where, f"the shape of tensor '{fqn}'")
            st = StoredTensor(fqn, dtype, shape)
            for ch in entry.chunks:
                offsets = _ints(getattr(ch, "offsets", None), where, f"a chunk offset of tensor '{fqn}'")
                sizes = _ints(getattr(ch, "sizes", None), where, f"a chunk size of tensor '{fqn}'")
                if (
                    len(offsets) != len(shape)
                    or len(sizes) != len(shape)
                    or any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape))
                ):
                    # (A chunk outside the shape could also hide a gap in the chunks' coverage.)
                    raise CorruptCheckpointError(
                        f"{where}: tensor '{fqn}' of shape {shape} has a chunk "
                        f"at {offsets} of sizes {sizes}; the file is damaged"
                    )
                info = infos.get(offsets)
                if info is None:
                    raise CorruptCheckpointError(f"{where}: tensor '{fqn}' chunk at {offsets} has no storage entry")
                _refuse_transforms(where, f"tensor '{fqn}'", info)
                rel, offset, length = _location(info, where, f"tensor '{fqn}' chunk {offsets}")
                _check_chunk_bytes(where, fqn, dtype, offsets, sizes, rel, offset, length)
                crc = table.items.get((fqn, offsets))
                blocks = _block_crcs(table, fqn, offsets, length, crc, where) if table.blocks else b""
                st.chunks.append(StoredChunk(offsets, sizes, rel, offset, length, crc, blocks))
            tensors[fqn] = st
        elif isinstance(entry, BytesStorageMetadata):
            info = infos.get(None)
            if info is None:
                raise CorruptCheckpointError(f"{where}: object '{fqn}' has no storage entry")
            _refuse_transforms(where, f"object '{fqn}'", info)
            rel, offset, length = _location(info, where, f"object '{fqn}'")
            objects[fqn] = StoredObject(
                fqn, rel, offset, length, table.items.get((fqn, ())), _is_shard_key(fqn, _planner_path(md, fqn))
            )
    _check_table_keys(table, tensors, objects, where)
    return CheckpointIndex(tensors, objects, md, table.files.get(COMMON_PT), table.checksum, table.block_nbytes)


def _check_table_keys(
    table: _Table, tensors: dict[str, StoredTensor], objects: dict[str, StoredObject], where: Path | str
) -> None:
    """Every checksum the table records is of an item the checkpoint holds: the table's keys are
    written apart from the items they name, so a flipped bit in one leaves that item looked up
    without a checksum, and loaded unchecked."""
    held = {(t.fqn, c.offsets) for t in tensors.values() for c in t.chunks} | {(o.fqn, ()) for o in objects.values()}
    stray = sorted((set(table.items) | set(table.blocks)) - held)
    if stray:
        fqn, offsets = stray[0]
        raise CorruptCheckpointError(
            f"{where}: its checksum table ({CHECKSUMS_ATTR}) records {len(stray)} item(s) the checkpoint "
            f"does not hold, first '{fqn:.200}' at offsets {offsets}; the file is damaged. Load an "
            "earlier checkpoint."
        )


def _block_crcs(
    table: _Table, fqn: str, offsets: tuple[int, ...], length: int, crc: int | None, where: Path | str
) -> bytes:
    """A chunk's block checksums from the table, checked against its length (b"" if none)."""
    blocks = table.blocks.get((fqn, offsets), b"")
    if blocks and (crc is None or len(blocks) != 4 * block_count(length, table.block_nbytes)):
        raise CorruptCheckpointError(
            f"{where}: the checksum table gives tensor '{fqn}' chunk at {offsets} {len(blocks)} bytes of "
            f"block checksums for its {length} bytes; the file is damaged. Load an earlier checkpoint."
        )
    return blocks


def _check_chunk_bytes(
    where: Path | str,
    fqn: str,
    dtype: torch.dtype,
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
    rel: str,
    offset: int,
    length: int,
) -> None:
    """A chunk's elements must fit in its item: every torch_dist tensor item is a torch.save
    stream holding at least their bytes. A shape or dtype that says otherwise contradicts the data
    (and would make a load allocate what the file does not hold), so it is refused here, before
    any reader allocates from it."""
    need = math.prod(sizes) * dtype.itemsize
    if need > length:
        raise CorruptCheckpointError(
            f"{where}: tensor '{fqn}' chunk at {offsets} is recorded as {dtype} of sizes {sizes} "
            f"({need} bytes), but its item in {rel} (bytes [{offset}, {offset + length})) holds only "
            f"{length} bytes; the metadata contradicts the data (damaged). Load an earlier checkpoint."
        )


def records_from_index(index: CheckpointIndex) -> list[ItemRecord]:
    """The stored records of an existing checkpoint (rank is unknown: -1)."""
    out = [
        ItemRecord(
            fqn=t.fqn,
            kind=TENSOR,
            rank=-1,
            dtype=dtype_name(t.dtype, t.fqn, stored=True),
            global_shape=t.shape,
            offsets=c.offsets,
            sizes=c.sizes,
            relative_path=c.relative_path,
            file_offset=c.file_offset,
            length=c.length,
            crc=c.crc,
            # A table of another block size (a future writer's) cannot be rewritten as ours.
            block_crcs=c.block_crcs if index.block_nbytes == BLOCK_NBYTES else b"",
            path=planner_path(index, t.fqn),
        )
        for t in index.tensors.values()
        for c in t.chunks
    ]
    out += [
        ItemRecord(
            fqn=o.fqn,
            kind=BYTES,
            rank=-1,
            relative_path=o.relative_path,
            file_offset=o.file_offset,
            length=o.length,
            crc=o.crc,
            path=planner_path(index, o.fqn),
        )
        for o in index.objects.values()
    ]
    return out


def with_file_ranks(records: list[ItemRecord]) -> list[ItemRecord]:
    """Records from ``.metadata`` carry no rank; the data file name ``__<rank>_<n>.distcp`` has it
    (-1 where the file is named otherwise)."""
    out = []
    for r in records:
        m = DATA_FILE_PATTERN.match(r.relative_path)
        out.append(replace(r, rank=int(m.group(1)) if m else -1))
    return out


def planner_path(index: CheckpointIndex, fqn: str) -> tuple[str | int, ...]:
    """The state-dict path ``fqn`` was flattened from, as DCP's ``planner_data`` records it
    (``(fqn,)`` when it records none or something else)."""
    return _planner_path(index.raw, fqn)


def _planner_path(md: Metadata, fqn: str) -> tuple[str | int, ...]:
    planner_data = getattr(md, "planner_data", None)
    path = planner_data.get(fqn) if isinstance(planner_data, dict) else None
    if isinstance(path, (tuple, list)) and path and all(type(p) in (str, int) for p in path):
        return tuple(path)
    return (fqn,)


def _is_shard_key(fqn: str, path: tuple) -> bool:
    """Whether bytes item ``fqn`` is a ShardedObject shard (``<key>/shard_<offsets>_<shape>``,
    ``torch.save([obj])``) rather than a DCP value (``torch.save(value)``).

    A DCP value records the path it was flattened from in ``planner_data``; a key that only looks
    like a ShardedObject's (``{"meta": {"x/shard_0_1": 5}}``, path ``("meta", "x/shard_0_1")``) is
    therefore a value.
    """
    return path == (fqn,) and looks_like_object_key(fqn)


def common_items(index: CheckpointIndex) -> list[StoredObject]:
    """The bytes items that are common values, not ShardedObject shards, in key order."""
    return [obj for _, obj in sorted(index.objects.items()) if not obj.sharded_object]
