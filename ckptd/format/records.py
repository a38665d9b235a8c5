"""Item records: what one rank stores, as plain data that crosses process boundaries.

A record describes one stored item (a tensor chunk or a ShardedObject's bytes) and, once written,
where its bytes are. Records travel from ranks to the coordinator as msgpack maps of their fields
(never pickle; msgspec decodes them back into ItemRecords, ckptd.control.protocol), and the
coordinator turns all of them into the DCP ``.metadata``.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..errors import ProtocolError, ShardingError

if TYPE_CHECKING:
    import torch

    from ..mapping import ByteItem, ShardedObject, ShardedTensor

TENSOR = "tensor"
BYTES = "bytes"

# Bytes per element of every dtype ckptd saves on torch 2.13, by canonical name (str(dtype)
# without "torch."): what the node daemon, which never imports torch, checks records and sizes
# items with. The table ckptd derives from torch (:func:`_torch_dtypes`) is the authority:
# tests/unit/test_dcp_pickle.py checks this one against it, and a name only a newer torch has is
# looked up there (importing torch in that process).
_ITEMSIZE: dict[str, int] = {
    "bfloat16": 2,
    "bool": 1,
    "complex128": 16,
    "complex32": 4,
    "complex64": 8,
    "float16": 2,
    "float32": 4,
    "float4_e2m1fn_x2": 1,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "int8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "uint8": 1,
}


def _dcp_element_nbytes(dtype: torch.dtype) -> int | None:
    """A dtype's element size as torch DCP's save planner computes it (``torch._utils._element_size``,
    from finfo/iinfo bits), or None where that fails: DCP cannot save a tensor of that dtype."""
    import torch

    try:
        if dtype.is_complex:
            return torch.finfo(dtype).bits >> 2
        if dtype.is_floating_point:
            return torch.finfo(dtype).bits >> 3
        if dtype == torch.bool:
            return 1
        return torch.iinfo(dtype).bits >> 3
    except (TypeError, RuntimeError, ValueError):
        return None


def _storable(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` can be an item of a torch_dist checkpoint.

    Derived from torch, not listed by hand, so a new dtype torch DCP saves is supported as it
    comes: DCP's planner must know its element size, one whole number of bytes per element
    (sub-byte shells such as ``uint1``..``uint7``/``int1``..``int7`` and the ``bits*`` types have
    no finfo/iinfo: DCP's save fails on them, and torch.save refuses most), and it must not be
    a quantized dtype (its tensors carry scale and zero point, which DCP cannot save either).
    """
    import torch

    if _dcp_element_nbytes(dtype) != dtype.itemsize:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
        # on the meta device: no memory, and no fill (deterministic mode fills every new tensor,
        # which is not implemented for float4 on CPU)
        return not torch.empty(0, dtype=dtype, device="meta").is_quantized


def storable_dtypes() -> dict[str, torch.dtype]:
    """Every dtype of the installed torch a torch_dist checkpoint can hold, by canonical name."""
    import torch

    return {
        str(dt).removeprefix("torch."): dt
        for dt in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
        if _storable(dt)
    }


@functools.cache
def _torch_dtypes() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """Canonical names of every storable dtype (imported here, on first use) and the dtypes they
    name; records and the wire carry these names."""
    by_name = storable_dtypes()
    return by_name, {dt: name for name, dt in by_name.items()}


def supported_dtypes() -> tuple[torch.dtype, ...]:
    """Every dtype ckptd saves (the dtypes torch DCP saves that its daemons know), sorted by name."""
    by_name, _ = _torch_dtypes()
    return tuple(by_name[name] for name in sorted(by_name) if name in _ITEMSIZE)


def dtype_name(dtype: torch.dtype, key: str = "", *, stored: bool = False) -> str:
    """The canonical name of a storable ``dtype``; a ShardingError naming ``key`` otherwise, also
    for one this ckptd's daemons do not know (:data:`_ITEMSIZE`: a torch newer than ckptd) unless
    ``stored`` (a checkpoint holds it already: read, never refused for it)."""
    by_name, names = _torch_dtypes()
    name = names.get(dtype)
    if name is None or (name not in _ITEMSIZE and not stored):
        what = f"tensor '{key}'" if key else "a tensor"
        newer = name is not None
        raise ShardingError(
            f"{what} has dtype {dtype}, "
            + (
                "which this ckptd does not know yet (a torch newer than it): upgrade ckptd, or convert it"
                if newer
                else "which the torch_dist format cannot store (torch DCP saves only dtypes of whole bytes "
                "per element, not sub-byte, bits or quantized dtypes); convert it"
            )
            + " (e.g. to uint8 holding its packed bytes) before saving. Storable dtypes: "
            + ", ".join(sorted(_ITEMSIZE))
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _torch_dtypes()[0][name]
    except KeyError:
        raise ProtocolError(f"unknown dtype name {name!r}") from None


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype ``name`` names; ProtocolError for an unknown name. Never
    imports torch (the node daemon checks every record's dtype with it: a peer's unknown name made
    it import torch, 220 MiB): :data:`_ITEMSIZE` is every dtype torch 2.13 stores (a test compares
    them); a newer torch's dtype is refused by name where a rank plans its save (:func:`dtype_name`),
    not here by chance, depending on whether the process imported torch for something else."""
    itemsize = _ITEMSIZE.get(name)
    if itemsize is None:
        raise ProtocolError(f"unknown dtype name {name[:64]!r}")
    return itemsize


def check_dtype_name(name: str) -> None:
    """ProtocolError unless ``name`` names a storable dtype (see :func:`dtype_itemsize`)."""
    dtype_itemsize(name)


@dataclass(frozen=True, kw_only=True)
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
    # Checksum of the item's stored bytes (file[file_offset : file_offset + length]), computed while
    # writing: a CRC-32C for what ckptd writes; a record read back from ``.metadata`` holds what the
    # checkpoint's table recorded (zlib CRC-32 in tables of older ckptd: CheckpointIndex.checksum
    # says which). None when not recorded (checksums off, or written by torch DCP/megatron-core).
    crc: int | None = None
    # The CRC-32Cs of the stored bytes' blocks (ckptd.format.checksum: ``pack_blocks``), for an item
    # longer than one block whose checksums were recorded; else empty.
    block_crcs: bytes = b""
    # The state-dict path the key was flattened from (DCP's ``planner_data``), for DCP-style state
    # dicts; empty: the key itself.
    path: tuple[str | int, ...] = ()
    # A chunk of a DTensor: other ranks may store copies of it (a DTensor on a submesh is held by
    # every group of the mesh), which must be equal; also when the chunk is the whole tensor, which
    # a plain tensor's record looks like (ckptd.format.coverage).
    replicated: bool = False

    @property
    def nbytes(self) -> int:
        """Raw tensor bytes of the chunk (0 for byte items)."""
        if self.kind != TENSOR:
            return 0
        return math.prod(self.sizes) * dtype_itemsize(self.dtype)  # ProtocolError for an unknown name

    def stored_at(
        self, relative_path: str, file_offset: int, length: int, crc: int | None = None, block_crcs: bytes = b""
    ) -> ItemRecord:
        return replace(
            self, relative_path=relative_path, file_offset=file_offset, length=length, crc=crc, block_crcs=block_crcs
        )

    def where(self) -> str:
        if self.kind == TENSOR:
            return f"'{self.fqn}' chunk at offsets {self.offsets} (rank {self.rank})"
        return f"'{self.fqn}' (rank {self.rank})"


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
    dtype = dtype_name(sh.dtype, sh.key)
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
    (:func:`storage_pieces`); the loader still reads this grid layout (ckptd.loading.view).
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


def tensor_record(sh: ShardedTensor, rank: int, path: tuple[str | int, ...] = ()) -> ItemRecord:
    gshape, offsets, sizes = storage_layout(sh)
    return ItemRecord(
        fqn=sh.key,
        kind=TENSOR,
        rank=rank,
        dtype=dtype_name(sh.dtype, sh.key),
        global_shape=gshape,
        offsets=offsets,
        sizes=sizes,
        path=path,
    )


def object_record(sh: ShardedObject | ByteItem, rank: int, path: tuple[str | int, ...] = ()) -> ItemRecord:
    from ..mapping import ShardedObject

    key = sh.unique_key if isinstance(sh, ShardedObject) else sh.key
    return ItemRecord(fqn=key, kind=BYTES, rank=rank, path=path)
