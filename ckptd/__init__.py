"""ckptd: asynchronous, crash-consistent checkpoints of sharded PyTorch state (torch_dist format)."""

from .api import (
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    LoadMismatchError,
    ShardingError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .mapping import (
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)

__version__ = "0.1.0"

__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonPersistentObject",
    "is_main_replica",
    "CkptdError",
    "ShardingError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "LoadMismatchError",
    "UnsafePickleError",
    "UnsupportedFormatError",
]
