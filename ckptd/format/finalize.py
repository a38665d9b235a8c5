"""The coordinator's last step of a save: common state, DCP metadata, then the backend marker.

Order (each file written via tmp + fsync + rename, then the directory fsynced):
``common.pt`` -> ``.metadata`` -> ``metadata.json``. ``metadata.json`` last means a directory that
has it holds a complete checkpoint.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from .dcp_metadata import build_metadata, write_metadata
from .durable import Opener, atomic_write_bytes, default_opener
from .layout import COMMON_PT, METADATA_JSON, backend_metadata_bytes
from .records import ItemRecord
from .validate import validate_records


def serialize_common(common: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(common, buf)
    return buf.getvalue()


def finalize(
    directory: str | os.PathLike,
    records: list[ItemRecord],
    common_bytes: bytes,
    opener: Opener = default_opener,
    fsync: bool = True,
) -> None:
    """Validate all records and write the metadata files that make ``directory`` a checkpoint."""
    validate_records(records)
    directory = Path(directory)
    atomic_write_bytes(directory / COMMON_PT, common_bytes, opener, fsync)
    write_metadata(directory, build_metadata(records, str(directory)), opener, fsync)
    atomic_write_bytes(directory / METADATA_JSON, backend_metadata_bytes(), opener, fsync)
