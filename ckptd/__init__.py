"""ckptd: asynchronous, crash-consistent checkpoints of sharded PyTorch state (torch_dist format).

The public names are imported on first use (PEP 562): ``import ckptd`` alone loads neither torch
nor torch.distributed.checkpoint, so the command line (``ckptd --help``, ``ckptd status``) and a
daemon start without them; ``ckptd.save``, ``ckptd.Checkpointer``... import what they need.
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

# The errors are light (no torch): imported at once, so ``except ckptd.CkptdError`` costs nothing.
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CkptdError,
    CorruptCheckpointError,
    DaemonError,
    LoadMismatchError,
    NoCheckpointYetError,
    NodeFilesMissingError,
    SaveFailedError,
    SaveSkippedError,
    SaveTimeoutError,
    ShardingError,
    SharedMemoryFullError,
    StagingError,
    StorageError,
    UnknownClassError,
    UnsafePickleError,
    UnsupportedFormatError,
    UnsupportedLocationError,
)

if TYPE_CHECKING:
    from .api import (
        load,
        load_common_state_dict,
        load_content_metadata,
        load_plain_tensors,
        load_sharded_metadata,
        load_tensors_metadata,
        save,
    )
    from .client import Checkpointer, SaveHandle, SaveStatus
    from .config import CkptdConfig
    from .loading.execute import LoadStats
    from .loading.keymap import Fuse, Rename, Split, rules_from_config
    from .loading.strict import StrictHandling
    from .mapping import (
        LocalNonPersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        is_main_replica,
    )

# public name -> the module that defines it
_LAZY = {
    **dict.fromkeys(
        (
            "save",
            "load",
            "load_common_state_dict",
            "load_content_metadata",
            "load_plain_tensors",
            "load_sharded_metadata",
            "load_tensors_metadata",
        ),
        ".api",
    ),
    **dict.fromkeys(("Checkpointer", "SaveHandle", "SaveStatus"), ".client"),
    "CkptdConfig": ".config",
    "LoadStats": ".loading.execute",
    **dict.fromkeys(("Fuse", "Rename", "Split", "rules_from_config"), ".loading.keymap"),
    "StrictHandling": ".loading.strict",
    **dict.fromkeys(
        ("LocalNonPersistentObject", "ShardedObject", "ShardedTensor", "ShardedTensorFactory", "is_main_replica"),
        ".mapping",
    ),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


try:
    __version__ = _metadata.version("ckptd")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "save",
    "load",
    "Checkpointer",
    "SaveHandle",
    "SaveStatus",
    "CkptdConfig",
    "SaveFailedError",
    "SaveSkippedError",
    "SaveTimeoutError",
    "DaemonError",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonPersistentObject",
    "is_main_replica",
    "StrictHandling",
    "Rename",
    "Fuse",
    "Split",
    "rules_from_config",
    "LoadStats",
    "CkptdError",
    "ShardingError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointRemovedError",
    "NoCheckpointYetError",
    "CorruptCheckpointError",
    "LoadMismatchError",
    "NodeFilesMissingError",
    "UnknownClassError",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "UnsupportedLocationError",
    "StorageError",
    "StagingError",
    "SharedMemoryFullError",
]
