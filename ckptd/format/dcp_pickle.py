"""The DCP ``.metadata`` pickle, written without torch: the bytes ``pickle.dump(Metadata)`` gives.

torch DCP stores ``.metadata`` as a pickled ``torch.distributed.checkpoint.metadata.Metadata``.
Pickling the real object needs its classes, and importing them costs a process torch and DCP
(about 190 MiB of resident memory): the node daemon commits a save without them. This module
writes the same opcodes that CPython's C pickler (``pickle.dump``, what DCP's FileSystemWriter
calls) writes for the Metadata :func:`metadata_graph` describes: the classes by module and name
(``STACK_GLOBAL``), each object as ``NEWOBJ`` plus its state (``BUILD``), ``torch.Size`` and the
layout and memory-format encodings as ``REDUCE`` calls, every object memoized as the C pickler
memoizes it (equal objects shared where DCP's objects are shared), frames of 64 KiB committed where
it commits them. tests/unit/test_dcp_pickle.py checks the bytes against ``pickle.dumps`` of the
Metadata built from DCP's own classes, for many shapes of records and both protocols ckptd writes;
torch DCP, Megatron-Core and ckptd's reader therefore load exactly what they loaded before.

Only what a Metadata holds is written: None, bools, ints, str, tuples, lists, dicts and the
:class:`Global`, :class:`New` and :class:`Reduce` stand-ins below.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pickle import encode_long
from typing import Any

from .checksum import ALGORITHM, TABLE_VERSION
from .layout import COMMON_PT
from .records import TENSOR, ItemRecord, check_dtype_name

DCP_VERSION = "1.0.0"
# Extra attribute of the pickled Metadata holding ckptd's checksums (see ckptd.format.dcp_metadata).
CHECKSUMS_ATTR = "ckptd_checksums"

_FRAME_SIZE_TARGET = 64 * 1024
_FRAME_SIZE_MIN = 4
_BATCHSIZE = 1000  # items per SETITEMS/APPENDS, as pickle's


@dataclass(eq=False, frozen=True)
class Global:
    """A module-level name (a class, a function, a dtype), pickled as ``STACK_GLOBAL``. One
    object per name: the pickler writes it once and refers to it after."""

    module: str
    name: str


@dataclass(eq=False, frozen=True)
class New:
    """An instance of ``cls`` as ``object.__reduce_ex__`` pickles it: ``cls()`` (``NEWOBJ``) and,
    unless None, ``state`` set on it (``BUILD``)."""

    cls: Global
    state: Any = None


@dataclass(eq=False, frozen=True)
class Reduce:
    """``func(*args)`` (``REDUCE``)."""

    func: Global
    args: tuple


def _fresh(s: str) -> str:
    """An equal str that is a new object: the C pickler memoizes by identity, and a module name
    that torch's objects hold as distinct objects must be written (and memoized) once each."""
    return "".join(list(s))


# One str object per way the C pickler obtains a module name (see _fresh): DCP's classes share
# their module's name; a dtype's module is found by scanning sys.modules (its key, "torch");
# torch.Size and the layout function carry their own __module__.
_DCP_METADATA_MODULE = _fresh("torch.distributed.checkpoint.metadata")
_DCP_FILESYSTEM_MODULE = _fresh("torch.distributed.checkpoint.filesystem")
_DTYPE_MODULE = _fresh("torch")

METADATA = Global(_DCP_METADATA_MODULE, "Metadata")
TENSOR_STORAGE_METADATA = Global(_DCP_METADATA_MODULE, "TensorStorageMetadata")
BYTES_STORAGE_METADATA = Global(_DCP_METADATA_MODULE, "BytesStorageMetadata")
CHUNK_STORAGE_METADATA = Global(_DCP_METADATA_MODULE, "ChunkStorageMetadata")
TENSOR_PROPERTIES = Global(_DCP_METADATA_MODULE, "TensorProperties")
STORAGE_META = Global(_DCP_METADATA_MODULE, "StorageMeta")
METADATA_INDEX = Global(_DCP_METADATA_MODULE, "MetadataIndex")
MEM_FORMAT_ENCODING = Global(_DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING")
STORAGE_INFO = Global(_DCP_FILESYSTEM_MODULE, "_StorageInfo")
TORCH_SIZE = Global(_fresh("torch"), "Size")
GET_LAYOUT = Global(_fresh("torch.serialization"), "_get_layout")

_STRIDED = Reduce(GET_LAYOUT, ("torch.strided",))  # torch.strided, one object
_CONTIGUOUS = Reduce(MEM_FORMAT_ENCODING, (0,))  # _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT


class _Dtypes:
    """The ``Global`` of each dtype name (a dtype is one object: written once, then referred to)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Global] = {}

    def __call__(self, name: str) -> Global:
        found = self._by_name.get(name)
        if found is None:
            check_dtype_name(name)
            found = self._by_name[name] = Global(_DTYPE_MODULE, name)
        return found


def _size(dims: Iterable[int]) -> Reduce:
    """``torch.Size(dims)``: its ``__reduce__`` gives ``(torch.Size, (tuple(self),))``, a new tuple."""
    return Reduce(TORCH_SIZE, ((*dims,),))  # a new tuple even of a tuple (tuple(t) is t)


def metadata_graph(records: list[ItemRecord], checkpoint_id: str | None = None, common_crc32: int | None = None) -> New:
    """The DCP Metadata of all ranks' stored records (chunk lists in offset order), as stand-ins.

    Item checksums (``ItemRecord.crc32``) and ``common_crc32`` are kept in the extra attribute
    :data:`CHECKSUMS_ATTR`, which DCP and Megatron-Core ignore. Objects are shared exactly as
    ``ckptd.format.dcp_metadata`` built them with DCP's classes (what decides the memo, and so the
    bytes).
    """
    dtype = _Dtypes()
    state: dict[str, New] = {}
    storage: dict[New, New] = {}
    chunks: dict[str, list[ItemRecord]] = defaultdict(list)
    paths: dict[str, tuple] = {}
    # Equal values as one object (a data file's name, a chunk size, a key): pickle writes an
    # object once and then refers to it, so .metadata gets smaller and faster to write and read
    # (4,096 ranks x 4 records: 2.68 -> 2.22 MB), whatever the records came from (each decoded
    # from a message on its own).
    shared: dict[Any, Any] = {}
    sizes: dict[tuple[int, ...], Reduce] = {}

    def size(shape: tuple[int, ...]) -> Reduce:
        found = sizes.get(shape)
        if found is None:
            found = sizes[shape] = _size(shape)
        return found

    def storage_info(r: ItemRecord) -> New:
        rel = shared.setdefault(r.relative_path, r.relative_path)
        return New(STORAGE_INFO, {"relative_path": rel, "offset": r.file_offset, "length": r.length})

    for r in records:
        if r.path:
            paths[r.fqn] = tuple(r.path)
        if r.kind == TENSOR:
            chunks[shared.setdefault(r.fqn, r.fqn)].append(r)
        else:
            state[r.fqn] = New(BYTES_STORAGE_METADATA)
            storage[New(METADATA_INDEX, {"fqn": r.fqn, "index": None})] = storage_info(r)
    for fqn, items in chunks.items():
        items.sort(key=lambda r: r.offsets)
        properties = New(TENSOR_PROPERTIES, (dtype(items[0].dtype), _STRIDED, False, _CONTIGUOUS, False))
        chunk_list = [New(CHUNK_STORAGE_METADATA, {"offsets": _size(r.offsets), "sizes": size(r.sizes)}) for r in items]
        state[fqn] = New(
            TENSOR_STORAGE_METADATA,
            {"properties": properties, "size": _size(items[0].global_shape), "chunks": chunk_list},
        )
        for i, r in enumerate(items):
            index = New(METADATA_INDEX, {"fqn": fqn, "index": i, "offset": _size(r.offsets)})
            storage[index] = storage_info(r)
    md_state: dict[str, Any] = {
        "state_dict_metadata": dict(sorted(state.items())),
        # As DCP records it: the state-dict path each key was flattened from.
        "planner_data": {fqn: paths.get(fqn, (fqn,)) for fqn in sorted(state)},
        "storage_data": storage,
        "storage_meta": New(
            STORAGE_META, {"checkpoint_id": checkpoint_id, "save_id": None, "load_id": None, "modules": []}
        ),
        "version": DCP_VERSION,
    }
    item_crcs = {
        (shared.setdefault(r.fqn, r.fqn), tuple(r.offsets) if r.kind == TENSOR else ()): r.crc32
        for r in records
        if r.crc32 is not None
    }
    if item_crcs or common_crc32 is not None:
        md_state[CHECKSUMS_ATTR] = {
            "version": TABLE_VERSION,
            "algorithm": ALGORITHM,
            "items": item_crcs,
            "files": {} if common_crc32 is None else {COMMON_PT: common_crc32},
        }
    return New(METADATA, md_state)


def metadata_pickle(
    records: list[ItemRecord],
    checkpoint_id: str | None = None,
    common_crc32: int | None = None,
    protocol: int = 4,
) -> bytes:
    """``.metadata``'s bytes: ``pickle.dumps(Metadata, protocol)`` of the records' Metadata
    (:func:`metadata_graph`). ``protocol`` 4 (``pickle.DEFAULT_PROTOCOL``, what DCP writes) or 5
    (the same opcodes here)."""
    return dumps(metadata_graph(records, checkpoint_id, common_crc32), protocol)


def dumps(obj: Any, protocol: int = 4) -> bytes:
    """The C pickler's bytes for ``obj`` (see the module docstring for what ``obj`` may hold)."""
    if protocol not in (4, 5):
        raise ValueError(f"protocol {protocol} is not written here (4 or 5)")
    return _Writer(protocol).dump(obj)


_PACK_Q = struct.Struct("<Q").pack
_PACK_I = struct.Struct("<I").pack
_PACK_i = struct.Struct("<i").pack


class _Writer:
    """CPython's ``_pickle.Pickler`` (protocols 4 and 5) for the types :func:`dumps` takes."""

    def __init__(self, protocol: int) -> None:
        self.protocol = protocol
        self.out = bytearray()
        self.frame_start = -1  # where the current frame's 9-byte header is reserved, -1: none
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # memoized objects stay alive: their ids stay theirs

    def dump(self, obj: Any) -> bytes:
        self.out += bytes((0x80, self.protocol))
        self._save(obj)
        self._write(b".")
        self._commit_frame()
        return bytes(self.out)

    # framing: a frame opens with the first write after the previous one was committed
    def _write(self, data: bytes) -> None:
        if self.frame_start == -1:
            self.frame_start = len(self.out)
            self.out += b"\0" * 9
        self.out += data

    def _commit_frame(self) -> None:
        if self.frame_start == -1:
            return
        start = self.frame_start
        n = len(self.out) - start - 9
        if n >= _FRAME_SIZE_MIN:
            self.out[start : start + 9] = b"\x95" + _PACK_Q(n)
        else:
            del self.out[start : start + 9]
        self.frame_start = -1

    def _memoize(self, obj: Any) -> None:
        self.memo[id(obj)] = len(self.memo)
        self.keep.append(obj)
        self._write(b"\x94")

    def _save(self, obj: Any) -> None:
        # Like the C pickler, a full frame is committed as the next object starts.
        if self.frame_start != -1 and len(self.out) - self.frame_start - 9 >= _FRAME_SIZE_TARGET:
            self._commit_frame()
        t = type(obj)
        if obj is None:
            self._write(b"N")
            return
        if t is bool:
            self._write(b"\x88" if obj else b"\x89")
            return
        if t is int:
            self._save_int(obj)
            return
        if t is tuple and not obj:
            self._write(b")")
            return
        index = self.memo.get(id(obj))
        if index is not None:
            self._write(b"h" + bytes((index,)) if index < 256 else b"j" + _PACK_I(index))
            return
        if t is str:
            self._save_str(obj)
        elif t is tuple:
            self._save_tuple(obj)
        elif t is dict:
            self._write(b"}")
            self._memoize(obj)
            self._save_items(obj)
        elif t is list:
            self._write(b"]")
            self._memoize(obj)
            self._save_list(obj)
        elif t is New:
            self._save(obj.cls)
            self._save(())  # no arguments
            self._write(b"\x81")
            self._memoize(obj)
            if obj.state is not None:
                self._save(obj.state)
                self._write(b"b")
        elif t is Reduce:
            self._save(obj.func)
            self._save(obj.args)
            self._write(b"R")
            self._memoize(obj)
        elif t is Global:
            self._save(obj.module)
            self._save(obj.name)
            self._write(b"\x93")
            self._memoize(obj)
        else:
            raise TypeError(f"a {t.__name__} cannot be part of the DCP metadata pickle")

    def _save_int(self, x: int) -> None:
        if 0 <= x <= 0xFF:
            self._write(b"K" + bytes((x,)))
        elif 0 <= x <= 0xFFFF:
            self._write(b"M" + bytes((x & 0xFF, x >> 8)))
        elif -0x80000000 <= x <= 0x7FFFFFFF:
            self._write(b"J" + _PACK_i(x))
        else:
            encoded = encode_long(x)
            n = len(encoded)
            self._write((b"\x8a" + bytes((n,)) if n < 256 else b"\x8b" + _PACK_i(n)) + encoded)

    def _save_str(self, s: str) -> None:
        data = s.encode("utf-8", "surrogatepass")
        n = len(data)
        if n < 256:
            header = b"\x8c" + bytes((n,))
        elif n <= 0xFFFFFFFF:
            header = b"X" + _PACK_I(n)
        else:
            header = b"\x8d" + _PACK_Q(n)
        if n >= _FRAME_SIZE_TARGET:  # large payloads go outside any frame
            self._commit_frame()
            self.out += header + data
        else:
            self._write(header + data)
        self._memoize(s)

    def _save_tuple(self, t: tuple) -> None:
        n = len(t)
        if n <= 3:
            for item in t:
                self._save(item)
            self._write((b"\x85", b"\x86", b"\x87")[n - 1])
        else:
            self._write(b"(")
            for item in t:
                self._save(item)
            self._write(b"t")
        self._memoize(t)

    def _save_list(self, items: list) -> None:
        if not items:
            return
        if len(items) == 1:
            self._save(items[0])
            self._write(b"a")
            return
        for start in range(0, len(items), _BATCHSIZE):
            self._write(b"(")
            for item in items[start : start + _BATCHSIZE]:
                self._save(item)
            self._write(b"e")

    def _save_items(self, d: dict) -> None:
        if not d:
            return
        if len(d) == 1:
            ((k, v),) = d.items()
            self._save(k)
            self._save(v)
            self._write(b"s")
            return
        pairs = list(d.items())
        # The C pickler ends a dict of a multiple of 1,000 items with an empty batch.
        for start in range(0, len(pairs) + 1, _BATCHSIZE):
            self._write(b"(")
            for k, v in pairs[start : start + _BATCHSIZE]:
                self._save(k)
                self._save(v)
            self._write(b"u")
