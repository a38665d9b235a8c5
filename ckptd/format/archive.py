"""Structural check of a ``torch.save`` stream (a zip archive) without unpickling anything.

Every item torch DCP, Megatron-Core and ckptd write is such a stream: a tensor's, and also a
byte item's (a ShardedObject, or any non-tensor value DCP saves: an ``iteration`` int, an
optimizer's ``param_groups``, an ``io.BytesIO``). A byte item may hold objects of arbitrary
classes, which ``ckptd verify`` must not unpickle; this check finds the damage it can without
that: a broken or truncated zip, an entry outside the item, and an entry whose bytes disagree
with the CRC-32 the zip records for it.

Records are read through :mod:`zipfile`. torch writes a record's CRC-32 as 0 when it was told not
to compute it (ckptd does so for tensor items while its own per-item CRC-32 covers their bytes);
zipfile cannot read such a record without failing its CRC check, so its local header and bounds
are checked by hand (:func:`_record_start`): reading a 64 MiB tensor record through zipfile took
about 21 ms (a CRC and a copy of every byte) against 0.03 ms for the header (one core of the CI
machine, Python 3.11), and ``ckptd verify --deep`` does it for every tensor item ckptd wrote.

:func:`decode_problem` is the check every ``torch.load`` of ckptd runs first (``common.pt``,
ShardedObjects, values, tensor items it cannot read raw), so that what decoding allocates is
bounded by the bytes on disk: torch inflates a record compressed with deflate to whatever size its
header claims (torch.save never compresses, so such a record is refused), reads torch's legacy
(non-zip) format by allocating the storages its pickle declares (refused: torch.save writes zip
since torch 1.6), and its weights-only unpickler calls ``bytearray(n)`` and the legacy
``torch.FloatStorage(n)`` / ``torch.FloatTensor(n, m)`` constructors with any size. The pickle is
therefore first run against stand-ins (:class:`_AllocationScan`: no class of the pickle is looked
up, nothing of it runs), which refuse such calls with sizes beyond the file's and storages whose
declared size differs from their record's.
"""

from __future__ import annotations

import _compat_pickle
import functools
import io
import math
import pickle
import struct
import warnings
import zipfile
from typing import Any, BinaryIO

_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_NBYTES = 30
_READ_NBYTES = 1 << 20


def is_zip_stream(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts like a zip archive (what ``torch.save`` writes since torch 1.6)."""
    return bytes(data[:4]) == _LOCAL_HEADER


def torch_save_problem(data: bytes) -> str | None:
    """What is wrong with the ``torch.save`` archive ``data``, or None when it is well formed.

    Checks: everything :func:`decode_problem` checks; every entry with a recorded CRC-32 matches
    it (``ckptd verify --deep``).
    """
    return decode_problem(io.BytesIO(data), check_crcs=True)


def decode_problem(f: BinaryIO, *, check_crcs: bool = False) -> str | None:
    """Why ``torch.load`` of the stream ``f`` (seekable, at any position) would allocate more than
    its bytes or cannot work, or None (see the module docstring); reads only the zip directory,
    local headers and ``data.pkl``.

    Checks: a zip archive whose central directory decodes; exactly one ``<archive>/data.pkl``;
    every record stored uncompressed (torch never compresses), its local header where the
    directory says and its bytes inside the stream; the pickle's storages each match the size of
    their record; no size-taking constructor asks for more elements than the stream has bytes.
    ``check_crcs``: also read every record with a recorded CRC-32 and compare (before the pickle is
    scanned, so that a flipped bit is named as such).
    """
    f.seek(0, io.SEEK_END)
    size = f.tell()
    f.seek(0)
    zip_like = f.read(4) == _LOCAL_HEADER
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, struct.error, EOFError) as exc:
        if not zip_like:
            return (
                "is not a torch.save zip archive (torch's legacy format, or not torch.save at all; its "
                "decoder allocates whatever sizes the file declares, so ckptd does not read it)"
            )
        return f"is not a well-formed torch.save archive ({exc})"
    pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pickles) != 1:
        return f"is not a torch.save archive (it holds {len(pickles)} data.pkl records, not 1)"
    starts: dict[str, int] = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            return (
                f"record {info.filename} is compressed (method {info.compress_type}, {info.compress_size} "
                f"bytes inflating to {info.file_size}); torch.save never compresses, so it is not read"
            )
        start = _record_start(f, info, size)
        if isinstance(start, str):
            return start
        starts[info.filename] = start
    if check_crcs:
        for info in infos:
            if info.CRC and (problem := _read_problem(zf, info)) is not None:
                return problem
    pkl = pickles[0]
    f.seek(starts[pkl.filename])
    data_pkl = f.read(pkl.file_size)
    prefix = pkl.filename[: -len("data.pkl")]
    records = {
        i.filename[len(prefix) + len("data/") :]: i.file_size for i in infos if i.filename.startswith(prefix + "data/")
    }
    return _AllocationScan(data_pkl, records, size).problem()


def _read_problem(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> str | None:
    """Read a record through zipfile, which checks its local header, that its bytes are all there
    and that they match the CRC-32 the archive records."""
    name = info.filename
    try:
        f = zf.open(info)
    except (zipfile.BadZipFile, OSError, ValueError, struct.error) as exc:
        return f"record {name} has no valid local header at offset {info.header_offset} ({exc})"
    except (NotImplementedError, RuntimeError) as exc:  # flags torch never writes: patched data, encryption
        return f"record {name} has a local header torch never writes ({exc})"
    try:
        with f:
            while f.read(_READ_NBYTES):
                pass
    except EOFError:
        return f"record {name} needs {info.compress_size} bytes but the item ends before: it is truncated"
    except zipfile.BadZipFile:
        return f"record {name} does not match the CRC-32 {info.CRC:#010x} the archive records for it"
    return None


def _record_start(f: BinaryIO, info: zipfile.ZipInfo, size: int) -> int | str:
    """Where the bytes of a stored record start in ``f`` (its local header read by hand, see the
    module docstring), or what is wrong: no local header there, or bytes beyond ``size``."""
    name, at = info.filename, info.header_offset
    if not 0 <= at < size:  # a flipped bit in the central directory (zipfile subtracts its prefix)
        return f"record {name} has its local header at offset {at}, outside the archive's {size} bytes"
    f.seek(at)
    head = f.read(_LOCAL_HEADER_NBYTES)
    if len(head) != _LOCAL_HEADER_NBYTES or head[:4] != _LOCAL_HEADER:
        return f"record {name} has no local header at offset {at}"
    name_nbytes, extra_nbytes = struct.unpack_from("<HH", head, 26)
    start = at + _LOCAL_HEADER_NBYTES + name_nbytes + extra_nbytes
    if start + info.compress_size > size:
        end = start + info.compress_size
        return f"record {name} needs bytes [{start}, {end}) but the archive has {size}: it is truncated"
    return start


class _Refused(Exception):
    """What :class:`_AllocationScan` found."""


# Constructors that allocate what their int arguments say (weights-only allow-listed): bytearray,
# the legacy typed storages and tensors (torch.FloatStorage(n), torch.FloatTensor(n, m)).
def _allocates(qualname: str) -> bool:
    module, _, name = qualname.rpartition(".")
    if qualname == "builtins.bytearray":
        return True
    return module in ("torch", "torch.storage", "torch.cuda", "torch.sparse", "torch.cuda.sparse") and (
        name.endswith("Storage") or name.endswith("Tensor")
    )


# An allow-listed rebuild function that calls the constructor it is given with its third argument.
# (_rebuild_qtensor allocates its size too, but in elements of a quantized dtype, half or a quarter
# of a byte for quint4x2 and quint2x4: not bounded here, it would refuse genuine ones.)
_CALLS_ON_SIZES = frozenset({"torch._tensor._rebuild_from_type_v2"})


@functools.cache
def _storage_itemsize(qualname: str) -> int | None:
    """Bytes per element of a storage class a torch.save pickle names (``torch.FloatStorage``: 4;
    ``torch.UntypedStorage``: 1); None when unknown (torch then checks the size itself)."""
    import torch

    name = qualname.rpartition(".")[2]
    if name == "UntypedStorage":
        return 1
    cls = getattr(torch, name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading a TypedStorage class attribute warns
        dtype = getattr(cls, "dtype", None) if isinstance(cls, type) else None
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def _ints(value: Any) -> list[int]:
    """The sizes a constructor argument names: an int, a tuple or list of them, a torch.Size."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _ints(v)]
    if isinstance(value, _Stand):
        return [n for v in value.args for n in _ints(v)]
    return []


class _Stand:
    """What a call or an object of the pickle becomes during the scan: inert, records its args."""

    qualname = "?"
    scan: _AllocationScan | None = None
    args: tuple = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = object.__new__(cls)
        self.args = args
        if cls.scan is not None:
            cls.scan.called(cls.qualname, args)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Stand:
        out = object.__new__(_Stand)
        out.args = args
        return out

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _AllocationScan(pickle.Unpickler):
    """Runs a torch.save ``data.pkl`` against :class:`_Stand` classes (nothing of the pickle is
    looked up or run) to find what decoding it for real would allocate beyond the archive's
    ``size``: a storage whose declared size differs from its record's (torch reads the record and
    compares afterwards), or a size-taking constructor called with sizes beyond ``size``."""

    def __init__(self, data_pkl: bytes, records: dict[str, int], size: int) -> None:
        super().__init__(io.BytesIO(data_pkl))
        self._records = records
        self._size = size
        self._classes: dict[str, type[_Stand]] = {}

    def problem(self) -> str | None:
        try:
            self.load()
        except _Refused as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a pickle no torch.load could decode either
            return f"holds a data.pkl that cannot be decoded ({exc!r})"
        return None

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 pickles (torch.save's) name builtins as Python 2 did ("__builtin__ bytearray"),
        # which unpicklers map to today's names, as here.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        qualname = f"{module}.{name}"
        cls = self._classes.get(qualname)
        if cls is None:
            cls = self._classes[qualname] = type("_Stand", (_Stand,), {"qualname": qualname, "scan": self})
        return cls

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, stype, key, _location, numel = pid
            record = self._records.get(str(key))
            if record is None:
                raise _Refused(f"has a storage '{key}' without a data/{key} record")
            itemsize = _storage_itemsize(getattr(stype, "qualname", ""))
            if itemsize is not None and (type(numel) is not int or numel * itemsize != record):
                raise _Refused(
                    f"declares storage '{key}' of {numel!r} elements of {itemsize} bytes, but its record "
                    f"holds {record} bytes"
                )
        return object.__new__(_Stand)

    def called(self, qualname: str, args: tuple) -> None:
        if qualname in _CALLS_ON_SIZES and len(args) > 2:
            # _rebuild_from_type_v2(torch.FloatTensor, type, (n,), state) calls FloatTensor(n) itself.
            inner = getattr(args[0], "qualname", "")
            sizes_arg = args[2] if isinstance(args[2], (tuple, list)) else (args[2],)
            if _allocates(inner):
                self.called(inner, tuple(sizes_arg))
            return
        if _allocates(qualname):
            sizes = _ints(args)
            if any(n < 0 for n in sizes) or math.prod(sizes) > self._size:
                raise _Refused(
                    f"calls {qualname} with sizes {sizes[:8]}, more than the {self._size} bytes of the "
                    "archive: decoding it would allocate memory the file does not hold"
                )
