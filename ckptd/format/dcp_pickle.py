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

Only what a Metadata holds is written: None, bools, ints, str, bytes (block checksums), tuples, lists, dicts and the
:class:`Global`, :class:`New` and :class:`Reduce` stand-ins below.
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Iterable
from pickle import encode_long
from typing import Any

from .checksum import ALGORITHM, BLOCK_NBYTES, TABLE_VERSION
from .layout import COMMON_PT
from .records import TENSOR, ItemRecord, check_dtype_name

DCP_VERSION = "1.0.0"
# Extra attribute of the pickled Metadata holding ckptd's checksums (see ckptd.format.dcp_metadata).
CHECKSUMS_ATTR = "ckptd_checksums"

_FRAME_SIZE_TARGET = 64 * 1024
# The opcodes of a str and of a bytes payload: under 256 bytes, under 4 GiB, larger.
_STR_OPS = (b"\x8c", b"X", b"\x8d")
_BYTES_OPS = (b"C", b"B", b"\x8e")
_FRAME_SIZE_MIN = 4
_BATCHSIZE = 1000  # items per SETITEMS/APPENDS, as pickle's


# Plain classes with slots, not dataclasses: a Metadata of 10,000 items makes 60,000 of them.
# Compared and hashed by identity, as the pickler memoizes them.


class Global:
    """A module-level name (a class, a function, a dtype), pickled as ``STACK_GLOBAL``. One
    object per name: the pickler writes it once and refers to it after."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module = module
        self.name = name


class New:
    """An instance of ``cls`` as ``object.__reduce_ex__`` pickles it: ``cls()`` (``NEWOBJ``) and,
    unless None, ``state`` set on it (``BUILD``)."""

    __slots__ = ("cls", "state")

    def __init__(self, cls: Global, state: Any = None) -> None:
        self.cls = cls
        self.state = state


class Reduce:
    """``func(*args)`` (``REDUCE``)."""

    __slots__ = ("args", "func")

    def __init__(self, func: Global, args: tuple) -> None:
        self.func = func
        self.args = args


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


def metadata_graph(records: list[ItemRecord], checkpoint_id: str | None = None, common_crc: int | None = None) -> New:
    """The DCP Metadata of all ranks' stored records (chunk lists in offset order), as stand-ins.

    Item checksums (``ItemRecord.crc``) and ``common_crc`` are kept in the extra attribute
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
        (shared.setdefault(r.fqn, r.fqn), tuple(r.offsets) if r.kind == TENSOR else ()): r.crc
        for r in records
        if r.crc is not None
    }
    # Only tensor chunks: a load reads an object whole.
    block_crcs = {
        (shared.setdefault(r.fqn, r.fqn), tuple(r.offsets)): r.block_crcs
        for r in records
        if r.block_crcs and r.crc is not None and r.kind == TENSOR
    }
    if item_crcs or common_crc is not None:
        md_state[CHECKSUMS_ATTR] = {
            "version": TABLE_VERSION,
            "algorithm": ALGORITHM,
            "items": item_crcs,
            "files": {} if common_crc is None else {COMMON_PT: common_crc},
            "block_nbytes": BLOCK_NBYTES,
            "blocks": block_crcs,
        }
    return New(METADATA, md_state)


def metadata_pickle(
    records: list[ItemRecord],
    checkpoint_id: str | None = None,
    common_crc: int | None = None,
    protocol: int = 4,
) -> bytes:
    """``.metadata``'s bytes: ``pickle.dumps(Metadata, protocol)`` of the records' Metadata
    (:func:`metadata_graph`). ``protocol`` 4 (``pickle.DEFAULT_PROTOCOL``, what DCP writes) or 5
    (the same opcodes here)."""
    return dumps(metadata_graph(records, checkpoint_id, common_crc), protocol)


def dumps(obj: Any, protocol: int = 4) -> bytes:
    """The C pickler's bytes for ``obj`` (see the module docstring for what ``obj`` may hold).

    The C pickler memoizes by identity: ``obj`` keeps every object it holds alive while this
    runs, so no id is reused. One function with the state in closure cells, not methods: a
    Metadata of 10,000 items is about 650,000 objects to write.
    """
    if protocol not in (4, 5):
        raise ValueError(f"protocol {protocol} is not written here (4 or 5)")
    out = bytearray((0x80, protocol))
    memo: dict[int, int] = {}
    # Where the open frame's 9-byte header is reserved (the C pickler opens a frame with the
    # first write after committing one; nothing is written between a commit and the next
    # save, so the next frame is opened at once).
    frame_start = len(out)
    out += _NO_HEADER

    def commit(reopen: bool) -> None:
        nonlocal frame_start
        n = len(out) - frame_start - 9
        if n >= _FRAME_SIZE_MIN:
            out[frame_start : frame_start + 9] = b"\x95" + _PACK_Q(n)
        else:
            del out[frame_start : frame_start + 9]
        if reopen:
            frame_start = len(out)
            out.extend(_NO_HEADER)

    gets = _BINGET  # BINGET of memo indices below 256

    def save(obj: Any) -> None:
        nonlocal out, frame_start
        # Like the C pickler, a full frame is committed as the next object starts.
        if len(out) - frame_start - 9 >= _FRAME_SIZE_TARGET:
            commit(True)
        t = type(obj)
        if t is int:
            if 0 <= obj <= 0xFF:
                out += _BININT1[obj]
            elif 0 <= obj <= 0xFFFF:
                out += b"M" + _PACK_H(obj)
            elif -0x80000000 <= obj <= 0x7FFFFFFF:
                out += b"J" + _PACK_i(obj)
            else:
                encoded = encode_long(obj)
                n = len(encoded)
                out += (b"\x8a" + _BYTE[n] if n < 256 else b"\x8b" + _PACK_i(n)) + encoded
            return
        if obj is None:
            out += b"N"
            return
        if t is bool:
            out += b"\x88" if obj else b"\x89"
            return
        if t is tuple and not obj:
            out += b")"
            return
        index = memo.get(id(obj))
        if index is not None:
            out += gets[index] if index < 256 else b"j" + _PACK_I(index)
            return
        if t is str or t is bytes:
            # SHORT_BINUNICODE / BINUNICODE / BINUNICODE8 for str, SHORT_BINBYTES / BINBYTES /
            # BINBYTES8 for bytes, then MEMOIZE
            data = obj.encode("utf-8", "surrogatepass") if t is str else obj
            ops = _STR_OPS if t is str else _BYTES_OPS
            n = len(data)
            if n < 256:
                out += ops[0] + _BYTE[n] + data + b"\x94"
            else:
                header = ops[1] + _PACK_I(n) if n <= 0xFFFFFFFF else ops[2] + _PACK_Q(n)
                if n >= _FRAME_SIZE_TARGET:  # large payloads go between frames, not in one
                    commit(False)
                    out += header + data
                    frame_start = len(out)
                    out += _NO_HEADER + b"\x94"
                else:
                    out += header + data + b"\x94"
            memo[id(obj)] = len(memo)
        elif t is New:
            index = memo.get(id(obj.cls))
            if index is not None:  # save(obj.cls), inline: the class was written before
                out += gets[index] if index < 256 else b"j" + _PACK_I(index)
            else:
                save(obj.cls)
            # save(()), inline: no arguments
            if len(out) - frame_start - 9 >= _FRAME_SIZE_TARGET:
                commit(True)
            out += b")\x81\x94"  # EMPTY_TUPLE, NEWOBJ, MEMOIZE
            memo[id(obj)] = len(memo)
            if obj.state is not None:
                save(obj.state)
                out += b"b"
        elif t is dict:
            out += b"}\x94"
            memo[id(obj)] = len(memo)
            n = len(obj)
            if n == 1:
                for k, v in obj.items():
                    save(k)
                    save(v)
                out += b"s"
            elif n:
                # batches of 1,000: MARK ... SETITEMS; the C pickler ends a dict of a multiple of
                # 1,000 items with an empty batch
                out += b"("
                i = 0
                for k, v in obj.items():
                    if i == _BATCHSIZE:
                        out += b"u("
                        i = 0
                    # save(k), save(v), inline for what most keys and values are: an object
                    # written before (a key of a state dict, a file name) and a small int
                    if len(out) - frame_start - 9 >= _FRAME_SIZE_TARGET:
                        commit(True)
                    index = memo.get(id(k))
                    if index is not None:
                        out += gets[index] if index < 256 else b"j" + _PACK_I(index)
                    else:
                        save(k)
                    if len(out) - frame_start - 9 >= _FRAME_SIZE_TARGET:
                        commit(True)
                    if type(v) is int and 0 <= v <= 0xFF:
                        out += _BININT1[v]
                    else:
                        index = memo.get(id(v))
                        if index is not None:
                            out += gets[index] if index < 256 else b"j" + _PACK_I(index)
                        else:
                            save(v)
                    i += 1
                out += b"u(u" if i == _BATCHSIZE else b"u"
        elif t is tuple:
            n = len(obj)
            if n > 3:
                out += b"("
            for item in obj:
                # save(item), inline for a small int (offsets, sizes)
                if type(item) is int and 0 <= item <= 0xFF:
                    if len(out) - frame_start - 9 >= _FRAME_SIZE_TARGET:
                        commit(True)
                    out += _BININT1[item]
                else:
                    save(item)
            out += _TUPLE_N[n] if n <= 3 else b"t\x94"
            memo[id(obj)] = len(memo)
        elif t is Reduce:
            save(obj.func)
            save(obj.args)
            out += b"R\x94"
            memo[id(obj)] = len(memo)
        elif t is Global:
            save(obj.module)
            save(obj.name)
            out += b"\x93\x94"
            memo[id(obj)] = len(memo)
        elif t is list:
            out += b"]\x94"
            memo[id(obj)] = len(memo)
            n = len(obj)
            if n == 1:
                save(obj[0])
                out += b"a"
            elif n:
                for start in range(0, n, _BATCHSIZE):  # no empty batch after a multiple here
                    out += b"("
                    for item in obj[start : start + _BATCHSIZE]:
                        save(item)
                    out += b"e"
        else:
            raise TypeError(f"a {t.__name__} cannot be part of the DCP metadata pickle")

    save(obj)
    out += b"."
    commit(False)
    return bytes(out)


_PACK_Q = struct.Struct("<Q").pack
_PACK_I = struct.Struct("<I").pack
_PACK_i = struct.Struct("<i").pack
_PACK_H = struct.Struct("<H").pack
_BYTE = [bytes((i,)) for i in range(256)]
_BININT1 = [b"K" + b for b in _BYTE]
_BINGET = [b"h" + b for b in _BYTE]
_TUPLE_N = (b")", b"\x85\x94", b"\x86\x94", b"\x87\x94")
_NO_HEADER = bytes(9)
