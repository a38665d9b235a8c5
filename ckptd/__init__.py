"""ckptd: asynchronous, crash-consistent checkpoints of sharded PyTorch state (torch_dist format)."""

from importlib import metadata as _metadata

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
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CkptdError,
    CorruptCheckpointError,
    DaemonError,
    LoadMismatchError,
    SaveFailedError,
    SaveSkippedError,
    SaveTimeoutError,
    ShardingError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .load.execute import LoadStats
from .load.keymap import Fuse, Rename, Split, rules_from_config
from .load.strict import StrictHandling
from .mapping import (
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

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
    "CorruptCheckpointError",
    "LoadMismatchError",
    "UnsafePickleError",
    "UnsupportedFormatError",
]
