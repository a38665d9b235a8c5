"""Item records: what one rank stores, as plain data that crosses process boundaries.

A record describes one stored item (a tensor chunk or a ShardedObject's bytes) and, once written,
where its bytes are. Records travel from ranks to the coordinator as msgpack maps (never pickle),
and the coordinator turns all of them into the DCP ``.metadata``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..errors import ProtocolError, ShardingError
from ..mapping import ByteItem, ShardedObject, ShardedTensor

TENSOR = "tensor"
BYTES = "bytes"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
        "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
        "uint16", "uint32", "uint64",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise ShardingError(f"dtype {dtype} is not supported by the checkpoint format")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype name {name!r}") from None


@dataclass(frozen=True)
class ItemRecord:
    """One stored item. Storage fields are empty until the item is written."""

    fqn: str
    kind: str  # TENSOR or BYTES
    rank: int
    dtype: str = ""
    global_shape: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    relative_path: str = ""
    file_offset: int = -1
    length: int = -1
    # zlib CRC-32 of the item's stored bytes (file[file_offset : file_offset + length]), computed
    # while writing; None when not recorded (checksums off, or written by torch DCP/megatron-core).
    crc32: int | None = None
    # The state-dict path the key was flattened from (DCP's ``planner_data``), for DCP-style state
    # dicts; empty: the key itself.
    path: tuple[str | int, ...] = ()

    @property
    def nbytes(self) -> int:
        """Raw tensor bytes of the chunk (0 for byte items)."""
        if self.kind != TENSOR:
            return 0
        itemsize = _ITEMSIZE.get(self.dtype)
        if itemsize is None:
            dtype_from_name(self.dtype)  # raises ProtocolError for an unknown name
        return math.prod(self.sizes) * itemsize

    def stored_at(self, relative_path: str, file_offset: int, length: int,
                  crc32: int | None = None) -> "ItemRecord":
        return replace(self, relative_path=relative_path, file_offset=file_offset, length=length,
                       crc32=crc32)

    def where(self) -> str:
        if self.kind == TENSOR:
            return f"'{self.fqn}' chunk at offsets {self.offsets} (rank {self.rank})"
        return f"'{self.fqn}' (rank {self.rank})"

    def to_wire(self) -> dict[str, Any]:
        # Field by field (what asdict() gives, ~10x faster: a save sends one per item).
        d = {name: getattr(self, name) for name in _RECORD_FIELDS}
        for k in ("global_shape", "offsets", "sizes", "path"):
            d[k] = list(d[k])
        return d

    @classmethod
    def from_wire(cls, d: Any) -> "ItemRecord":
        try:
            rec = cls(
                fqn=str(d["fqn"]),
                kind=str(d["kind"]),
                rank=int(d["rank"]),
                dtype=str(d.get("dtype", "")),
                global_shape=tuple(map(int, d.get("global_shape", ()))),
                offsets=tuple(map(int, d.get("offsets", ()))),
                sizes=tuple(map(int, d.get("sizes", ()))),
                relative_path=str(d.get("relative_path", "")),
                file_offset=int(d.get("file_offset", -1)),
                length=int(d.get("length", -1)),
                crc32=None if d.get("crc32") is None else int(d["crc32"]),
                path=tuple(_path_part(p) for p in d.get("path", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed item record: {exc!r}") from exc
        if rec.kind not in (TENSOR, BYTES):
            raise ProtocolError(f"malformed item record: unknown kind {rec.kind!r}")
        if rec.kind == TENSOR:
            dtype_from_name(rec.dtype)
            if not len(rec.global_shape) == len(rec.offsets) == len(rec.sizes):
                raise ProtocolError(f"malformed item record for {rec.fqn!r}: rank mismatch of shapes")
        return rec


def _path_part(p: Any) -> str | int:
    if type(p) is int or type(p) is str:
        return p
    raise TypeError(f"path part {p!r} is neither a str nor an int")


_RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ItemRecord))
_ITEMSIZE: dict[str, int] = {name: torch.empty((), dtype=dt).element_size() for name, dt in _DTYPES.items()}


def storage_pieces(sh: ShardedTensor) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]:
    """``(global_shape, offsets, sizes, flat_start)`` of each item a ShardedTensor is stored as.

    An N-D shard is one item: its chunk. A flattened shard (``flattened_range``, distributed
    optimizer) is stored as the N-D boxes of the global tensor its flat range covers (at most
    ``2 * ndim - 1``: a partial leading row, a block of whole rows, a partial trailing row,
    recursively), so the checkpoint holds the tensor in its real global shape: any layout, flat or
    N-D, loads it (also torch DCP and Megatron-Core, which reject flattened ranges), and no
    regular grid is needed. ``flat_start`` is the piece's first element within ``sh.data``.
    """
    if sh.flattened_range is None:
        return [(sh.global_shape, sh.global_offset, sh.chunk_shape(), 0)]
    from .geometry import flat_range_boxes

    start = sh.flattened_range.start
    return [
        (sh.global_shape, tuple(g + o for g, o in zip(sh.global_offset, off)), sizes, flat - start)
        for off, sizes, flat in flat_range_boxes(sh.chunk_shape(), start, sh.flattened_range.stop)
    ]


def tensor_records(sh: ShardedTensor, rank: int) -> list[ItemRecord]:
    """One record per stored item of ``sh`` (see :func:`storage_pieces`)."""
    dtype = dtype_name(sh.dtype)
    return [
        ItemRecord(fqn=sh.key, kind=TENSOR, rank=rank, dtype=dtype, global_shape=g, offsets=o, sizes=s)
        for g, o, s, _ in storage_pieces(sh)
    ]


def storage_layout(sh: ShardedTensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(global_shape, offsets, sizes)`` of the *legacy* single-item layout of a ShardedTensor.

    Regular tensors are stored as themselves. For a flattened shard this is the way Megatron-Core
    (< 0.14) stored distributed-optimizer state in torch_dist: the global tensor becomes a grid of
    flattened local chunks, shape ``axis_fragmentations + (chunk_numel,)``, and the shard is the
    slice ``flattened_range`` of its grid cell. ckptd now writes flattened shards as N-D pieces
    (:func:`storage_pieces`); the loader still reads this grid layout (ckptd.load.view).
    """
    if sh.flattened_range is None:
        return sh.global_shape, sh.global_offset, sh.chunk_shape()
    fragments = tuple(sh.axis_fragmentations or ())
    chunk = sh.chunk_shape()
    for axis, (off, size) in enumerate(zip(sh.global_offset, chunk)):
        if size == 0 or off % size:
            raise ShardingError(
                f"ShardedTensor '{sh.key}': flattened shard's chunk offset {off} on axis {axis} "
                f"is not a multiple of its chunk size {size}; flattened shards need a regular grid"
            )
    cell = tuple(off // size for off, size in zip(sh.global_offset, chunk))
    numel = math.prod(chunk)
    fr = sh.flattened_range
    return (
        fragments + (numel,),
        cell + (fr.start,),
        (1,) * len(cell) + (fr.stop - fr.start,),
    )


def tensor_record(sh: ShardedTensor, rank: int) -> ItemRecord:
    gshape, offsets, sizes = storage_layout(sh)
    return ItemRecord(
        fqn=sh.key,
        kind=TENSOR,
        rank=rank,
        dtype=dtype_name(sh.dtype),
        global_shape=gshape,
        offsets=offsets,
        sizes=sizes,
    )


def object_record(sh: ShardedObject | ByteItem, rank: int, path: tuple[str | int, ...] = ()) -> ItemRecord:
    key = sh.unique_key if isinstance(sh, ShardedObject) else sh.key
    return ItemRecord(fqn=key, kind=BYTES, rank=rank, path=path)
