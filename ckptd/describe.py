"""What a checkpoint holds, from its index alone (``ckptd inspect``).

:func:`describe_checkpoint` reads ``metadata.json``, ``.metadata`` and (weights-only) ``common.pt``;
it reads no tensor data. The summary lists every tensor with its chunking (how many chunks, which
chunk shapes, which data files), every byte item (ShardedObjects), the data files and the keys of
the common state.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .errors import CheckpointNotFoundError, UnsafePickleError
from .format.dcp_metadata import read_index
from .format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON, read_backend_metadata
from .format.reader import read_common
from .format.safefs import entry_exists, is_entry_name, is_regular_file
from .storage.s3view import s3_checkpoint_view
from .storage.url import S3Location, parse_location


@dataclass
class TensorInfo:
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int
    chunk_shapes: list[tuple[tuple[int, ...], int]]  # (chunk shape, how many), most common first
    files: list[str]
    checksummed_chunks: int


@dataclass
class ObjectInfo:
    key: str
    file: str
    offset: int
    length: int
    checksummed: bool


@dataclass
class CheckpointSummary:
    path: str
    backend: dict[str, Any] | None  # metadata.json; None for a plain torch DCP checkpoint
    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[ObjectInfo] = field(default_factory=list)
    data_files: dict[str, int] = field(default_factory=dict)  # name -> bytes on disk (-1: missing)
    common: dict[str, str] | None = None  # top-level key -> type name
    common_note: str | None = None  # why the common keys are not shown
    checksummed_items: int = 0
    items: int = 0

    @property
    def tensor_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def data_nbytes(self) -> int:
        return sum(max(0, n) for n in self.data_files.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for t in d["tensors"]:
            t["shape"] = list(t["shape"])
            t["chunk_shapes"] = [{"shape": list(s), "count": n} for s, n in t["chunk_shapes"]]
        d["tensor_nbytes"] = self.tensor_nbytes
        d["data_nbytes"] = self.data_nbytes
        return d


def _type_name(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def describe_checkpoint(
    checkpoint_dir: str | os.PathLike | S3Location, *, allow_unsafe_pickle: bool = False
) -> CheckpointSummary:
    """Summarize one checkpoint directory (or ``s3://`` checkpoint, through its local view: only
    its metadata is read); raises a CkptdError when its index cannot be read."""
    location = parse_location(checkpoint_dir)
    if isinstance(location, S3Location):
        with s3_checkpoint_view(location) as view:
            return replace(
                describe_checkpoint(view.directory, allow_unsafe_pickle=allow_unsafe_pickle), path=str(location)
            )
    root = location
    backend = read_backend_metadata(root) if entry_exists(root, METADATA_JSON) else None
    if backend is None and not entry_exists(root, DCP_METADATA):
        raise CheckpointNotFoundError(f"{root} is not a checkpoint: neither {METADATA_JSON} nor {DCP_METADATA} exists")
    index = read_index(root, allow_unsafe_pickle)
    out = CheckpointSummary(str(root), backend)
    files: set[str] = set()
    for key, t in sorted(index.tensors.items()):
        element = t.dtype.itemsize
        shapes = Counter(c.sizes for c in t.chunks)
        chunk_files = sorted({c.relative_path for c in t.chunks})
        files.update(chunk_files)
        done = sum(c.crc is not None for c in t.chunks)
        out.tensors.append(
            TensorInfo(
                key,
                str(t.dtype).removeprefix("torch."),
                t.shape,
                math.prod(t.shape) * element,
                len(t.chunks),
                shapes.most_common(),
                chunk_files,
                done,
            )
        )
        out.items += len(t.chunks)
        out.checksummed_items += done
    for key, o in sorted(index.objects.items()):
        out.objects.append(ObjectInfo(key, o.relative_path, o.file_offset, o.length, o.crc is not None))
        files.add(o.relative_path)
        out.items += 1
        out.checksummed_items += o.crc is not None
    for name in sorted(files):
        path = root / name
        # Sizes of regular files inside the checkpoint only: a link is not followed (-1, as missing).
        out.data_files[name] = path.lstat().st_size if is_entry_name(name) and is_regular_file(path) else -1
    if not entry_exists(root, COMMON_PT):
        out.common_note = f"no {COMMON_PT}"
        return out
    try:
        common = read_common(root, allow_unsafe_pickle)
    except UnsafePickleError:
        out.common_note = (
            f"{COMMON_PT} holds objects outside torch's weights-only allow-list; "
            "pass --allow-unsafe-pickle to list its keys (only if you trust it)"
        )
        return out
    except Exception as exc:  # noqa: BLE001 - a damaged common.pt must not hide the index
        out.common_note = f"{COMMON_PT} cannot be decoded ({exc}); run ckptd verify"
        return out
    if isinstance(common, dict):
        out.common = {str(k): _type_name(v) for k, v in common.items()}
    else:
        out.common_note = f"{COMMON_PT} holds a {type(common).__name__}, not a dict"
    return out
