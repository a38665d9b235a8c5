"""Reading items back from data files, with checks that name the damaged file."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import CorruptCheckpointError, UnsafePickleError
from .layout import COMMON_PT


class DataFiles:
    """Open data files of one checkpoint, kept open while a load runs.

    Usage: ``with DataFiles(dir) as files: files.read(rel_path, offset, length)``.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._open: dict[str, tuple[BinaryIO, int]] = {}

    def __enter__(self) -> "DataFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        for f, _ in self._open.values():
            f.close()
        self._open.clear()

    def _file(self, relative_path: str) -> tuple[BinaryIO, int]:
        if relative_path not in self._open:
            path = self.directory / relative_path
            if os.sep in relative_path or relative_path.startswith(".."):
                raise CorruptCheckpointError(f"metadata names data file {relative_path!r} outside the checkpoint")
            try:
                f = open(path, "rb")  # noqa: SIM115 - closed in __exit__
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"data file {path} is missing; the checkpoint is incomplete. Load an earlier "
                    "checkpoint, or restore the file."
                ) from None
            self._open[relative_path] = (f, os.fstat(f.fileno()).st_size)
        return self._open[relative_path]

    def read(self, relative_path: str, offset: int, length: int, what: str) -> bytes:
        f, size = self._file(relative_path)
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptCheckpointError(
                f"data file {self.directory / relative_path} is truncated: {what} needs bytes "
                f"[{offset}, {offset + length}) but the file has {size}. Load an earlier checkpoint."
            )
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise CorruptCheckpointError(f"short read of {what} from {self.directory / relative_path}")
        return data


def load_tensor_bytes(data: bytes, what: str, where: str) -> torch.Tensor:
    try:
        t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(f"{what} in {where} cannot be decoded ({exc}); the file is damaged") from exc
    if not isinstance(t, torch.Tensor):
        raise CorruptCheckpointError(f"{what} in {where} holds a {type(t).__name__}, not a tensor")
    return t


def unpickle_torch(data: bytes | BinaryIO, what: str, allow_unsafe_pickle: bool) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller opted into arbitrary pickles."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return torch.load(stream, map_location="cpu", weights_only=not allow_unsafe_pickle)
    except pickle.UnpicklingError as exc:
        if allow_unsafe_pickle:
            raise CorruptCheckpointError(f"{what} cannot be decoded ({exc})") from exc
        raise UnsafePickleError(
            f"{what} contains objects outside torch's weights-only allow-list ({exc}). If you "
            "trust this checkpoint, pass allow_unsafe_pickle=True to load it."
        ) from exc
    except Exception as exc:
        raise CorruptCheckpointError(f"{what} cannot be decoded ({exc!r}); the file is damaged") from exc


def load_object_bytes(data: bytes, what: str, allow_unsafe_pickle: bool) -> Any:
    """A ShardedObject item: ``torch.save([obj])``."""
    value = unpickle_torch(data, what, allow_unsafe_pickle)
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    raise CorruptCheckpointError(f"{what} does not hold a one-element list as Megatron-Core writes")


def read_common(directory: str | os.PathLike, allow_unsafe_pickle: bool = False) -> Any:
    """The common state dict (``common.pt``); an empty dict for a plain DCP checkpoint."""
    path = Path(directory) / COMMON_PT
    if not path.exists():
        return {}
    with open(path, "rb") as f:
        return unpickle_torch(f, f"common state {path}", allow_unsafe_pickle)
