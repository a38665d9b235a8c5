"""File names and the ``metadata.json`` marker of a torch_dist checkpoint directory.

```
<checkpoint>/
  metadata.json        backend marker; ckptd writes it last, so it marks a complete checkpoint
  common.pt            common (non-sharded) state of rank 0, torch.save
  .metadata            torch DCP Metadata (pickled), chunk index and storage offsets
  __<rank>_<n>.distcp  data files: concatenated items, each a torch.save stream
```
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import CheckpointNotFoundError, StorageError, UnsupportedFormatError
from .rootlayout import parse_step_dir
from .safefs import entry_exists, read_regular

METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"
DCP_METADATA = ".metadata"
DATA_SUFFIX = ".distcp"
# A data file of DCP's naming; group 1 is the rank that wrote it.
DATA_FILE_PATTERN = re.compile(r"^__(\d+)_\d+\.distcp$")

# Size limits of the files read whole: far above what a real checkpoint writes (metadata.json:
# ~150 bytes; .metadata: ~100 bytes per chunk; common.pt: the non-sharded state), so that a damaged
# or hostile file is refused at once instead of exhausting memory.
METADATA_JSON_MAX_NBYTES = 1 << 20
DCP_METADATA_MAX_NBYTES = 4 << 30
COMMON_PT_MAX_NBYTES = 64 << 30

BACKEND_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
SUPPORTED_SHARDED_BACKENDS = {("torch_dist", 1)}
SUPPORTED_COMMON_BACKENDS = {("torch", 1)}


def data_file_name(rank: int, index: int = 0) -> str:
    """DCP's data file naming: ``__<rank>_<n>.distcp``."""
    return f"__{rank}_{index}{DATA_SUFFIX}"


def backend_metadata_bytes() -> bytes:
    return json.dumps(BACKEND_METADATA).encode()


def read_backend_metadata(checkpoint_dir: str | os.PathLike) -> dict:
    """Read and check ``metadata.json``; raise if the directory is not a loadable checkpoint.

    A directory with a DCP ``.metadata`` but no ``metadata.json`` is a plain torch DCP checkpoint
    and reads as torch_dist.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"{root} is not a directory; pass the directory of one checkpoint "
            "(for a Checkpointer root, use Checkpointer(root).load())"
        )
    path = root / METADATA_JSON
    if not entry_exists(root, METADATA_JSON):
        if entry_exists(root, DCP_METADATA):
            # A plain torch DCP checkpoint: same sharded format, no common state.
            return dict(BACKEND_METADATA)
        hint = (
            " Pass the directory of one checkpoint (it holds metadata.json and .metadata, as "
            "ckptd, Megatron-Core and torch DCP write them)."
        )
        step_dir = parse_step_dir(root.name)
        if step_dir is not None and step_dir.partial:
            hint = " It is an uncommitted (.tmp) save, which is never loaded."
        raise CheckpointNotFoundError(f"{root} is not a checkpoint: {METADATA_JSON} is missing.{hint}")
    try:
        meta = json.loads(read_regular(root, METADATA_JSON, "backend marker", METADATA_JSON_MAX_NBYTES))
    except (FileNotFoundError, ValueError, RecursionError) as exc:
        raise UnsupportedFormatError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged") from exc
    except OSError as exc:  # the storage failed to answer: nothing is known of the file
        raise StorageError.reading(exc, path, "backend marker") from exc
    return check_backend_metadata(meta, path)


def check_backend_metadata(meta: object, where: str | os.PathLike = METADATA_JSON) -> dict:
    if not isinstance(meta, dict):
        raise UnsupportedFormatError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    sharded = (meta.get("sharded_backend"), meta.get("sharded_backend_version"))
    common = (meta.get("common_backend", "torch"), meta.get("common_backend_version", 1))
    # Compared by equality: a damaged file may hold unhashable values (lists, objects) here.
    if not any(sharded == ok for ok in SUPPORTED_SHARDED_BACKENDS):
        raise UnsupportedFormatError(
            f"{where}: sharded backend {sharded[0]!r} version {sharded[1]!r} is not supported; "
            f"ckptd reads {sorted(SUPPORTED_SHARDED_BACKENDS)}. Convert the checkpoint to "
            "torch_dist first (megatron-core ships a converter for zarr)."
        )
    if not any(common == ok for ok in SUPPORTED_COMMON_BACKENDS):
        raise UnsupportedFormatError(
            f"{where}: common backend {common[0]!r} version {common[1]!r} is not supported; "
            f"ckptd reads {sorted(SUPPORTED_COMMON_BACKENDS)}"
        )
    return meta
