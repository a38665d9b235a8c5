"""Structural check of a ``torch.save`` stream (a zip archive) without unpickling anything.

Every item torch DCP, Megatron-Core and ckptd write is such a stream: a tensor's, and also a
byte item's (a ShardedObject, or any non-tensor value DCP saves: an ``iteration`` int, an
optimizer's ``param_groups``, an ``io.BytesIO``). A byte item may hold objects of arbitrary
classes, which ``ckptd verify`` must not unpickle; this check finds the damage it can without
that: a broken or truncated zip, an entry outside the item, and an entry whose bytes disagree
with the CRC-32 the zip records for it.

torch writes a zip entry's CRC-32 as 0 when it was told not to compute it (ckptd does so for
tensor items while its own per-item CRC-32 covers their bytes); such entries are not checked.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib

_LOCAL_HEADER = b"PK\x03\x04"
_LOCAL_HEADER_NBYTES = 30


def is_zip_stream(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts like a zip archive (what ``torch.save`` writes since torch 1.6)."""
    return bytes(data[:4]) == _LOCAL_HEADER


def torch_save_problem(data: bytes) -> str | None:
    """What is wrong with the ``torch.save`` archive ``data``, or None when it is well formed.

    Checks: the central directory decodes; exactly one ``<archive>/data.pkl``; every entry is
    stored uncompressed (torch never compresses), has its local header where the directory says
    and lies inside ``data``; every entry with a recorded CRC-32 matches it.
    """
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, struct.error) as exc:
        return f"is not a well-formed torch.save archive ({exc})"
    pickles = [i.filename for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pickles) != 1:
        return f"is not a torch.save archive (it holds {len(pickles)} data.pkl records, not 1)"
    view = memoryview(data)
    for info in infos:
        name = info.filename
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            return f"record {name} is compressed (method {info.compress_type}); torch.save never compresses"
        at = info.header_offset
        head = bytes(view[at : at + _LOCAL_HEADER_NBYTES])
        if len(head) != _LOCAL_HEADER_NBYTES or head[:4] != _LOCAL_HEADER:
            return f"record {name} has no local header at offset {at}"
        name_nbytes, extra_nbytes = struct.unpack_from("<HH", head, 26)
        start = at + _LOCAL_HEADER_NBYTES + name_nbytes + extra_nbytes
        end = start + info.compress_size
        if end > len(data):
            return (f"record {name} needs bytes [{start}, {end}) but the item has {len(data)}: "
                    "it is truncated")
        if info.CRC and zlib.crc32(view[start:end]) != info.CRC:
            return (f"record {name} (bytes [{start}, {end}) of the item) does not match the CRC-32 "
                    f"{info.CRC:#010x} the archive records for it")
    return None
