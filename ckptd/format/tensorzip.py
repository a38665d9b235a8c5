"""A tensor item exactly as ``torch.save`` writes it, without torch: the node daemon's write path.

A tensor item of a torch_dist checkpoint is a ``torch.save`` archive of one tensor whose storage
holds exactly its elements (ckptd.format.items). The node daemon writes such items from raw bytes
in its staging rings; going through ``torch.save`` cost it a tensor over the ring, a pickler and a
zip writer per item (about 0.5 ms each on the CI machine: seconds for 10,000 items) and needed
torch in the daemon. :func:`write_raw_tensor` writes the same bytes directly: the archive of
torch 2.13's writer (PyTorch's miniz-based ``PyTorchStreamWriter``), byte for byte, which
tests/unit/test_tensorzip.py checks against ``torch.save`` for every storable dtype and many
shapes, with and without zip CRC-32s. Layout:

- records ``data.pkl`` (protocol-2 pickle: ``torch._utils._rebuild_tensor_v2`` of a persistent
  storage ``('storage', torch.<X>Storage, '0', 'cpu', numel)``, offset 0, size, contiguous stride,
  ``requires_grad=False``, an empty ``OrderedDict`` of hooks; for a dtype without a legacy
  storage type, ``_rebuild_tensor_v3`` of ``torch.storage.UntypedStorage`` of ``nbytes`` with the
  dtype as a last argument), ``.format_version`` (``1``),
  ``.storage_alignment`` (``64``), ``byteorder``, ``data/0`` (the bytes), ``version`` (``3``),
  ``.data/serialization_id``, each under ``archive/``;
- each record: a local header (no sizes, data descriptor flag), an extra field ``FB`` of ``Z``
  padding so that its data starts at a multiple of 64, the data, a 16-byte data descriptor;
- the central directory, a zip64 end record and locator, the end record (always, as torch does);
- the serialization id: two 20-digit numbers, c10's ``hash_combine`` over the record names
  (constant here) and over the non-empty records' CRC-32s (0 when CRCs are not computed).

Archives of 4 GiB or more need zip64 records in the middle of the file; those are left to
``torch.save`` (:func:`fits`).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

# The legacy storage type ``torch.save`` pickles a storage of a dtype as (by ckptd.format.records'
# dtype names); None: a dtype without one, pickled as an untyped storage plus the dtype.
STORAGE_TYPES: dict[str, str | None] = {
    "bfloat16": "BFloat16Storage",
    "bool": "BoolStorage",
    "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
    "float16": "HalfStorage",
    "float32": "FloatStorage",
    "float64": "DoubleStorage",
    "int16": "ShortStorage",
    "int32": "IntStorage",
    "int64": "LongStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    **dict.fromkeys(
        (
            "complex32",
            "float4_e2m1fn_x2",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "uint16",
            "uint32",
            "uint64",
        )
    ),
}
ITEMSIZE: dict[str, int] = {
    "bfloat16": 2, "bool": 1, "complex128": 16, "complex64": 8, "float16": 2, "float32": 4, "float64": 8,
    "int16": 2, "int32": 4, "int64": 8, "int8": 1, "uint8": 1, "complex32": 4, "float4_e2m1fn_x2": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "uint16": 2, "uint32": 4, "uint64": 8,
}  # fmt: skip

_ALIGN = 64
_FLAGS = 0x0808  # data descriptor follows; names are UTF-8
_FLAGS_EMPTY = 0x0800  # an empty record: no data descriptor
_LFH = struct.Struct("<4sHHHHHIIIHH")
_DD = struct.Struct("<4sIII")
_CDH = struct.Struct("<4sHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOC = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")
_NAMES = (
    b"archive/data.pkl",
    b"archive/.format_version",
    b"archive/.storage_alignment",
    b"archive/byteorder",
    b"archive/data/0",
    b"archive/version",
    b"archive/.data/serialization_id",
)
_DATA = 4  # index of the data record
# c10::hash_combine over std::hash of the record names above, as torch's writer computes it.
_NAME_HASH = 15728199511854643026
_MAX_NBYTES = 0xFFFFFFFF - (1 << 16)  # beyond: zip64 records (left to torch.save)
_U64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    return (seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2)) & _U64)) & _U64


@dataclass(frozen=True)
class RawTensor:
    """A tensor item given as raw bytes (row-major, exactly its elements): what the daemon has."""

    dtype: str  # ckptd.format.records' name ("float32", ...)
    shape: tuple[int, ...]
    data: Any  # a buffer of exactly numel * itemsize bytes (a view of a staging ring)


def fits(raw: RawTensor) -> bool:
    """Whether :func:`write_raw_tensor` writes this item (known dtype, archive under 4 GiB)."""
    return raw.dtype in STORAGE_TYPES and memoryview(raw.data).nbytes < _MAX_NBYTES


def _pickle_int(n: int) -> bytes:
    if 0 <= n <= 0xFF:
        return b"K" + bytes((n,))
    if 0 <= n <= 0xFFFF:
        return b"M" + n.to_bytes(2, "little")
    if -0x80000000 <= n <= 0x7FFFFFFF:
        return b"J" + n.to_bytes(4, "little", signed=True)
    body = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes((len(body),)) + body


class _Memo:
    """pickle's memo numbering (BINPUT after each memoized object, in order)."""

    def __init__(self) -> None:
        self.n = 0

    def put(self) -> bytes:
        self.n += 1
        return b"q" + bytes((self.n - 1,))


def _str(s: str, memo: _Memo) -> bytes:
    b = s.encode()
    return b"X" + len(b).to_bytes(4, "little") + b + memo.put()


def _tuple(items: tuple[int, ...], memo: _Memo) -> bytes:
    if not items:
        return b")"
    body = b"".join(_pickle_int(i) for i in items)
    if len(items) <= 3:
        return body + b"\x84\x85\x86\x87"[len(items) : len(items) + 1] + memo.put()
    return b"(" + body + b"t" + memo.put()


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's contiguous strides (a dimension of size 0 counts as 1)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def tensor_pickle(dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """``data.pkl`` of a CPU tensor of ``shape`` over a storage of exactly ``nbytes``, as
    ``torch.save`` pickles it (protocol 2)."""
    legacy = STORAGE_TYPES[dtype]
    memo = _Memo()
    out = b"\x80\x02ctorch._utils\n_rebuild_tensor_v" + (b"2" if legacy else b"3") + b"\n" + memo.put() + b"("
    storage = f"ctorch\n{legacy}\n" if legacy else "ctorch.storage\nUntypedStorage\n"
    out += b"(" + _str("storage", memo) + storage.encode() + memo.put() + _str("0", memo) + _str("cpu", memo)
    out += _pickle_int(nbytes // ITEMSIZE[dtype] if legacy else nbytes) + b"t" + memo.put() + b"Q"
    out += _pickle_int(0) + _tuple(shape, memo) + _tuple(contiguous_stride(shape), memo) + b"\x89"
    out += b"ccollections\nOrderedDict\n" + memo.put() + b")R" + memo.put()
    if not legacy:
        out += f"ctorch\n{dtype}\n".encode() + memo.put()
    return out + b"t" + memo.put() + b"R" + memo.put() + b"."


def _header(name: bytes, cursor: int, flags: int = _FLAGS) -> bytes:
    start = cursor + _LFH.size + len(name) + 4
    pad = -start % _ALIGN
    extra = b"FB" + pad.to_bytes(2, "little") + b"Z" * pad
    return _LFH.pack(b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


def write_raw_tensor(f: Any, raw: RawTensor, zip_crc32: bool) -> None:
    """Write ``raw`` into ``f`` as ``torch.save`` of that tensor would (see the module docstring),
    in three writes: headers, the data (one buffer, without a copy), the rest. ``zip_crc32``:
    compute the zip CRC-32s (torch's default); otherwise 0, as torch writes them with
    ``torch.utils.serialization.config.save.compute_crc32 = False``."""
    data = memoryview(raw.data).cast("B")
    small = [
        tensor_pickle(raw.dtype, raw.shape, data.nbytes),
        b"1",
        b"64",
        b"little",
        b"",  # the data record (written from ``data``)
        b"3\n",
    ]
    crcs = [zlib.crc32(b) if zip_crc32 else 0 for b in small]
    if zip_crc32:
        crcs[_DATA] = zlib.crc32(data)
    sizes = [len(b) for b in small]
    sizes[_DATA] = data.nbytes
    combined = 0
    for c, n in zip(crcs, sizes):
        if n:  # torch's writer folds in the CRC of non-empty records only
            combined = _hash_combine(combined, c)
    ident = f"{_NAME_HASH:020d}{combined:020d}".encode()
    small.append(ident)
    crcs.append(zlib.crc32(ident) if zip_crc32 else 0)
    sizes.append(len(ident))

    # An empty data record (a tensor of no elements) has no data descriptor, and says so.
    flags = [_FLAGS if n else _FLAGS_EMPTY for n in sizes]
    offsets: list[int] = []
    head = bytearray()
    cursor = 0
    for i, name in enumerate(_NAMES[: _DATA + 1]):
        offsets.append(cursor)
        h = _header(name, cursor, flags[i])
        head += h
        cursor += len(h)
        if i < _DATA:
            head += small[i] + _DD.pack(b"PK\x07\x08", crcs[i], sizes[i], sizes[i])
            cursor += sizes[i] + _DD.size
    cursor += data.nbytes
    tail = bytearray()
    if data.nbytes:
        tail += _DD.pack(b"PK\x07\x08", crcs[_DATA], sizes[_DATA], sizes[_DATA])
        cursor += _DD.size
    for i in range(_DATA + 1, len(_NAMES)):
        offsets.append(cursor)
        h = _header(_NAMES[i], cursor)
        rec = h + small[i] + _DD.pack(b"PK\x07\x08", crcs[i], sizes[i], sizes[i])
        tail += rec
        cursor += len(rec)
    cd_at = cursor
    cd = b"".join(
        _CDH.pack(b"PK\x01\x02", 0, 0, flags[i], 0, 0, 0, crcs[i], sizes[i], sizes[i], len(n), 0, 0, 0, 0, 0, at) + n
        for i, (n, at) in enumerate(zip(_NAMES, offsets))
    )
    tail += cd
    end64_at = cd_at + len(cd)
    n = len(_NAMES)
    tail += _ZIP64_END.pack(b"PK\x06\x06", _ZIP64_END.size - 12, 0x031E, 45, 0, 0, n, n, len(cd), cd_at)
    tail += _ZIP64_LOC.pack(b"PK\x06\x07", 0, end64_at, 1)
    tail += _END.pack(b"PK\x05\x06", 0, 0, n, n, len(cd), cd_at, 0)
    f.write(head)
    if data.nbytes:
        f.write(data)
    f.write(tail)
