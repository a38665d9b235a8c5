"""The coordinator's last step of a save: common state, DCP metadata, then the backend marker.

Order (each file written via tmp + fsync + rename, then the directory fsynced):
``common.pt`` -> ``.metadata`` -> ``metadata.json``. ``metadata.json`` last means a directory that
has it holds a complete checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

from .checksum import crc32c
from .dcp_metadata import build_metadata, write_metadata
from .durable import Opener, atomic_write_bytes, default_opener
from .layout import COMMON_PT, METADATA_JSON, backend_metadata_bytes
from .pickled import serialize_pickled
from .records import ItemRecord
from .safefs import Dir, entry_path
from .validate import validate_records


def serialize_common(common: Any) -> bytes:
    """``common.pt``'s bytes (tensors compacted, unpicklable values named; see .pickled)."""
    return serialize_pickled(common, "common state")


def finalize(
    directory: Dir | str | os.PathLike,
    records: list[ItemRecord],
    common_bytes: bytes,
    opener: Opener = default_opener,
    fsync: bool = True,
    checkpoint_id: str | None = None,
) -> None:
    """Validate all records and write the metadata files that make ``directory`` a checkpoint.

    ``checkpoint_id`` (recorded in ``.metadata``) defaults to ``directory``; an asynchronous commit
    passes the final name, since it finalizes in ``iter_<step>.<attempt>.tmp`` and renames afterwards. An open
    :class:`~ckptd.format.safefs.Dir` has its files created relative to it.
    """
    validate_records(records)
    atomic_write_bytes(entry_path(directory, COMMON_PT), common_bytes, opener, fsync)
    metadata = build_metadata(records, str(directory) if checkpoint_id is None else checkpoint_id,
                              common_crc32=crc32c(common_bytes))
    write_metadata(directory, metadata, opener, fsync)
    atomic_write_bytes(entry_path(directory, METADATA_JSON), backend_metadata_bytes(), opener, fsync)
