"""The ckptd exception hierarchy.

Every error raised to users is a :class:`CkptdError`. Messages say what was wrong, where (key,
rank, file) and what to do about it, so that a page at 3 a.m. can be acted on without reading
the source.
"""

from __future__ import annotations


class CkptdError(Exception):
    """Base class of every error ckptd raises on purpose."""


class ShardingError(CkptdError):
    """The sharded state dict is inconsistent (overlap, gap, shape/dtype disagreement, bad data).

    Raised before anything is written, so existing checkpoints are untouched.
    """


class CheckpointNotFoundError(CkptdError):
    """The directory is not a (committed) ckptd / torch_dist checkpoint."""


class CorruptCheckpointError(CkptdError):
    """A checkpoint's files are missing, truncated or do not match their metadata."""


class UnsupportedFormatError(CkptdError):
    """The checkpoint uses a backend or version ckptd cannot read."""


class LoadMismatchError(CkptdError):
    """What was requested at load does not match what the checkpoint holds (key, shape, dtype)."""


class UnsafePickleError(CkptdError):
    """Loading would need to unpickle arbitrary objects, which is off unless explicitly allowed."""


class CheckpointExistsError(CkptdError):
    """The target directory already holds a checkpoint; ckptd never overwrites one."""


class SaveFailedError(CkptdError):
    """A save did not commit (synchronous: writing failed; asynchronous: any party failed). The
    message lists the reason of every failed party."""


class SaveSkippedError(SaveFailedError):
    """The save was skipped by the backpressure policy (``on_full="skip"``)."""


class DaemonError(CkptdError):
    """The node daemon could not be reached, started, or answered with an error."""


class ProtocolError(CkptdError):
    """A control-plane message was malformed, of a wrong version, too large or unauthenticated."""


class StagingError(CkptdError):
    """Shared-memory staging failed (pool exhausted, segment missing, size mismatch)."""


class SaveTimeoutError(CkptdError, TimeoutError):
    """Waiting for an asynchronous save timed out; the save may still commit later."""
