"""The last step of a save: common state, DCP metadata, then the backend marker.

Order of :func:`finalize` (each file written via tmp + fsync + rename, then the directory
fsynced): ``common.pt`` -> ``.metadata`` -> ``metadata.json``. ``metadata.json`` last means a
directory that has it holds a complete checkpoint. A synchronous save's rank 0 and the coordinator
of an asynchronous one call it once every rank's data file is written; :func:`write_checkpoint`
does the whole sequence in one process (converters, tools and tests that write every rank's
file themselves).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .checksum import crc32c
from .dcp_pickle import metadata_pickle
from .direct import open_data_file
from .durable import Opener, atomic_write_bytes, default_opener
from .items import PlannedItem, write_data_file
from .layout import COMMON_PT, DCP_METADATA, METADATA_JSON, backend_metadata_bytes, data_file_name
from .records import ItemRecord
from .safefs import Dir, entry_path
from .validate import validate_records


def serialize_common(common: Any) -> bytes:
    """``common.pt``'s bytes (tensors compacted, unpicklable values named; see .pickled).
    Imports torch (a rank's step: rank 0 sends the node daemon these bytes)."""
    from .pickled import serialize_pickled

    return serialize_pickled(common, "common state")


def finalize(
    directory: Dir | str | os.PathLike,
    records: list[ItemRecord],
    common_bytes: bytes,
    opener: Opener = default_opener,
    fsync: bool = True,
    checkpoint_id: str | None = None,
) -> dict[str, bytes]:
    """Validate all records and write the metadata files that make ``directory`` a checkpoint;
    returns them, name -> bytes written.

    ``checkpoint_id`` (recorded in ``.metadata``) defaults to ``directory``; an asynchronous commit
    passes the final name, since it finalizes in ``iter_<step>.<attempt>.tmp`` and renames afterwards. An open
    :class:`~ckptd.format.safefs.Dir` has its files created relative to it.
    """
    validate_records(records)
    # The pickle of DCP's Metadata, written without DCP's classes (ckptd.format.dcp_pickle): the
    # node daemon that commits a save never imports torch.
    name = str(directory) if checkpoint_id is None else checkpoint_id
    files = {
        COMMON_PT: common_bytes,
        DCP_METADATA: metadata_pickle(records, name, crc32c(common_bytes)),
        METADATA_JSON: backend_metadata_bytes(),
    }
    for file_name, data in files.items():  # in the order of the module docstring
        atomic_write_bytes(entry_path(directory, file_name), data, opener, fsync)
    return files


def write_rank_files(
    directory: Dir | str | os.PathLike,
    ranks: Iterable[Sequence[PlannedItem]],
    *,
    opener: Opener = open_data_file,
    fsync: bool = True,
    checksums: bool = True,
) -> list[ItemRecord]:
    """Write each rank's items into its data file, one rank after the other in this process.

    ``ranks`` gives rank 0's items first; it is consumed lazily (a generator may build each rank's
    items after the previous rank's file is written, so only one rank's items are alive at a
    time). A rank without items gets no file, as in a real save. Returns every stored record.
    """
    records: list[ItemRecord] = []
    for rank, items in enumerate(ranks):
        if items:
            records += write_data_file(directory, data_file_name(rank), list(items), opener, fsync, checksums)
    return records


def write_checkpoint(
    directory: Dir | str | os.PathLike,
    ranks: Iterable[Sequence[PlannedItem]],
    common: Any | Callable[[], Any],
    *,
    opener: Opener = open_data_file,
    fsync: bool = True,
    checksums: bool = True,
) -> list[ItemRecord]:
    """Write a whole checkpoint into ``directory`` (which must exist) from this process: every
    rank's data file (:func:`write_rank_files`), then :func:`finalize` with ``common`` as the
    common state. ``common`` may be a function returning it, called once every data file is
    written (a converter learns it from the first rank's input). ``opener`` opens the data files.
    Returns every stored record."""
    records = write_rank_files(directory, ranks, opener=opener, fsync=fsync, checksums=checksums)
    finalize(directory, records, serialize_common(common() if callable(common) else common), fsync=fsync)
    return records
