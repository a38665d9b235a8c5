"""The ckptd exception hierarchy.

Every error raised to users is a :class:`CkptdError`. Messages say what was wrong, where (key,
rank, file) and what to do about it, so that a page at 3 a.m. can be acted on without reading
the source.
"""

from __future__ import annotations

import errno
import os


class CkptdError(Exception):
    """Base class of every error ckptd raises on purpose."""


class ShardingError(CkptdError):
    """The sharded state dict is inconsistent (overlap, gap, shape/dtype disagreement, bad data).

    Raised before anything is written, so existing checkpoints are untouched.
    """


class CheckpointNotFoundError(CkptdError):
    """The directory is not a (committed) ckptd / torch_dist checkpoint."""


class NoCheckpointYetError(CheckpointNotFoundError):
    """The root (and its mirror) holds no committed checkpoint yet: a fresh start. A resume
    (``Checkpointer.load()`` without ``step``) raises it on every rank alike (with torch.distributed
    initialized, as rank 0 found it); ``Checkpointer.resume()`` returns None instead.
    ``Checkpointer.checkpoint_dir()`` without ``step`` raises it as this rank finds the root."""


class CheckpointRemovedError(CheckpointNotFoundError):
    """The checkpoint was removed or moved away while it was being loaded (retention or
    ``ckptd gc`` where loads cannot hold a lease, or by hand). Nothing half-loaded is returned:
    load it again from another checkpoint (``Checkpointer.load()`` without ``step`` does so once
    by itself)."""


class CorruptCheckpointError(CkptdError):
    """A checkpoint's files are missing, truncated or do not match their metadata."""


class NodeFilesMissingError(CkptdError):
    """A rank resuming from node-local disks (config ``node_local``) needs files of the commit that
    neither its node's disk nor the mirror holds: the mirror's copy of the commit did not appear
    within the wait (``mirror_timeout_s``). Resume on the nodes that wrote the step, or once the
    copy is in the mirror."""


class UnsupportedFormatError(CkptdError):
    """The checkpoint uses a backend or version ckptd cannot read."""


class LoadMismatchError(CkptdError):
    """What was requested at load does not match what the checkpoint holds (key, shape, dtype)."""


class UnsafePickleError(CkptdError):
    """Loading would need to unpickle arbitrary objects, which is off unless explicitly allowed."""


class UnknownClassError(UnsafePickleError, UnsupportedFormatError):
    """A checkpoint's ``.metadata`` names a class ckptd does not know, outside the standard library
    and not a damaged spelling of one it knows: most likely a newer torch or Megatron-Core's. That
    is no damage: ``ckptd verify`` says UNSUPPORTED, and a resume raises it rather than fall back
    past the checkpoint (as a file the storage fails to return, :meth:`StorageError.reading`).
    Upgrade ckptd, or pass ``allow_unsafe_pickle=True`` if the checkpoint is trusted."""


class CheckpointExistsError(CkptdError):
    """The target directory already holds a checkpoint; ckptd never overwrites one."""


class OutputInsideCheckpointError(CkptdError):
    """A converted or consolidated file would be written into the checkpoint it is read from."""


class OutputExistsError(CheckpointExistsError):
    """A conversion's output path already exists and overwriting it was not asked for."""


class SaveFailedError(CkptdError):
    """A save did not commit (synchronous: writing failed; asynchronous: any party failed). The
    message lists the reason of every failed party."""


class SaveSkippedError(SaveFailedError):
    """The save was skipped by the backpressure policy (``on_full="skip"``)."""


class DaemonError(CkptdError):
    """The node daemon could not be reached, started, or answered with an error."""


class DaemonLostError(DaemonError):
    """The node daemon died (or was replaced) while a client depended on it."""


class RequestNotTaken(DaemonError):
    """The daemon certainly did not act on a request: it was never sent, or answered ERROR.

    (A request that timed out raises plain DaemonError: the daemon may still act on it.)
    ``code``: the refusal's code (:attr:`ProtocolError.code`), "" when there is none.
    """

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code

    @property
    def unknown_client(self) -> bool:
        """The daemon forgot this connection: HELLO and the ring registration must be repeated."""
        return self.code == UnknownClientError.code

    @property
    def attempt_in_use(self) -> bool:
        """Another save is being written under this attempt id (:class:`AttemptInUseError`)."""
        return self.code == AttemptInUseError.code

    @property
    def rank_held(self) -> bool:
        """Another running process saves as this rank (:class:`RankHeldError`)."""
        return self.code == RankHeldError.code


class ProtocolError(CkptdError):
    """A control-plane message was malformed, of a wrong version, too large or out of range."""

    # Travels in the ERROR reply (ckptd.control.protocol.ErrorReply.code), so that a client can act
    # on a refusal without parsing its text.
    code = ""


class UnknownClientError(ProtocolError):
    """The daemon does not know this connection (no HELLO, or it forgot the rank): the client
    must say HELLO and register its staging ring again."""

    code = "unknown_client"


class AttemptInUseError(ProtocolError):
    """Another save of this rank is being written under the same attempt id (two Checkpointers of
    one launch whose attempt ids repeat): the client must not abort that attempt on the other
    ranks, it is the other save's."""

    code = "attempt_in_use"


class RankHeldError(ProtocolError):
    """Another process that still runs saves as this rank through the same daemon (the same job
    launched twice on one machine): this one may load, but not save; and its refused save must
    not be announced to the other ranks (an abort of the step would abort the other launch's)."""

    code = "rank_held"


class StagingError(CkptdError):
    """Shared-memory staging failed (ring full, segment missing, size mismatch)."""


class SharedMemoryFullError(StagingError):
    """/dev/shm has no room for the staging pages a save needs (another process filled it, or
    it is smaller than the staging budget). That save fails; training goes on and the next save
    retries."""


class SaveTimeoutError(CkptdError, TimeoutError):
    """Waiting for an asynchronous save timed out; the save may still commit later."""


class CopyRoundError(CkptdError):
    """A round of the mirror copy of a commit held by node-local disks failed: ``node`` names the
    node that failed (None: no single one). Nothing of the round stays visible in the mirror; the
    copy is retried (ckptd.roots.mirror_nodes)."""

    def __init__(self, message: str, *, node: int | None) -> None:
        super().__init__(message)
        self.node = node


class UnsupportedLocationError(CkptdError):
    """A URL whose scheme ckptd cannot store checkpoints at, or a malformed ``s3://`` URL."""


class StorageError(CkptdError):
    """Writing checkpoint files failed: a full disk, missing permissions, a read-only or failing
    filesystem. Nothing of the save became visible; earlier checkpoints are untouched. Or reading
    them failed in a way that says nothing of their bytes (:meth:`reading`): never taken for damage."""

    @classmethod
    def from_oserror(cls, exc: OSError, path: str | os.PathLike) -> StorageError:
        """``<path>: <strerror> (<ERRNO>); <what to do>`` for the OSError of writing ``path``."""
        where = exc.filename if exc.filename is not None else path
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        name = errno.errorcode.get(exc.errno or 0, "unknown errno")
        hint = _STORAGE_HINTS.get(exc.errno or 0, "check the storage (dmesg, the filesystem's health)")
        return cls(f"{where}: {exc.strerror or exc} ({name}); {hint}")

    @classmethod
    def reading(cls, exc: OSError, path: str | os.PathLike, what: str) -> StorageError:
        """``reading <what> <path> failed: <strerror> (<ERRNO>); ...; <what to do>`` for the OSError
        of opening or reading ``path``. The storage did not answer (a network filesystem's ESTALE or
        EIO, too many open files, a permission): that says nothing of the file's bytes, so it is
        not damage, which a resume falls back past and a save of the step replaces (a fallback
        from an intact newest checkpoint leaves it on an abandoned branch for retention)."""
        where = exc.filename if exc.filename is not None else path
        name = errno.errorcode.get(exc.errno or 0, "unknown errno")
        hint = _READ_HINTS.get(
            exc.errno or 0,
            "retry once the storage answers again (a network filesystem: its server and mount); if it goes "
            "on failing, check the filesystem (dmesg), and if the disk is damaged load an earlier step "
            "explicitly (load(step=N))",
        )
        return cls(
            f"reading {what} {where} failed: {exc.strerror or exc} ({name}); not taken for damage (the file "
            f"may be intact): {hint}"
        )


# What to do when reading a checkpoint's file failed (StorageError.reading).
_READ_HINTS = {
    errno.EACCES: f"permission denied for uid {os.getuid()}: make the checkpoint readable for this user, then retry",
    errno.EPERM: f"operation not permitted for uid {os.getuid()}: make the checkpoint readable for this user, "
    "then retry",
    errno.EMFILE: "this process has too many files open: raise its limit (ulimit -n) or close files, then retry",
    errno.ENFILE: "the system's table of open files is full: retry once files are closed",
    errno.ESTALE: "a network filesystem's stale file handle (the server restarted, or the file was replaced "
    "on another client): retry",
    errno.ENOMEM: "out of memory: retry once memory is free",
}

_STORAGE_HINTS = {
    errno.ENOSPC: "the filesystem is full: free space on it, or keep fewer checkpoints (CKPTD_KEEP_LAST; "
    "a save needs room for one checkpoint more than it keeps: retention removes the oldest only once "
    "the new one committed), then save again",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota, then save again",
    errno.EACCES: f"permission denied for uid {os.getuid()}: make the checkpoint root writable for the daemon's user",
    errno.EPERM: f"operation not permitted for uid {os.getuid()}: make the checkpoint root writable "
    "for the daemon's user",
    errno.EROFS: "the filesystem is mounted read-only: remount it read-write or save to another root",
    errno.ENOENT: "the save's directory was removed meanwhile (its step was aborted, or `ckptd gc` "
    "removed it as abandoned)",
}
