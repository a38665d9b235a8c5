"""The handle an asynchronous save returns: poll it, wait for it, read its outcome."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from ..catalog import is_checkpoint_dir
from ..errors import CkptdError, SaveFailedError, SaveSkippedError, SaveTimeoutError
from ..format.safefs import is_real_dir
from ..s3catalog import checkpoint_exists
from ..storage.url import Location, S3Location
from .stats import SaveRecord, SaveStats

if TYPE_CHECKING:
    from .checkpointer import Checkpointer


class SaveStatus(str, enum.Enum):
    PENDING = "pending"  # handed to the daemon, not committed yet
    COMMITTED = "committed"  # durable, and named by the tracker unless a newer step is
    ABORTED = "aborted"  # failed somewhere (reason in ``error``); nothing of it is visible
    SKIPPED = "skipped"  # the on_full="skip" policy dropped the step, on this rank or another


class SaveHandle:
    """One rank's view of one asynchronous save. Use on the thread that owns the Checkpointer."""

    def __init__(
        self, owner: Checkpointer, step: int, path: Location, record: SaveRecord, stats: SaveStats, attempt: str = ""
    ) -> None:
        self._owner = owner
        self._stats = stats
        self.step = step
        self.attempt = attempt  # this try's attempt id (ckptd.control.attempt)
        self.path = path  # the committed directory or s3:// prefix (exists once COMMITTED)
        self.record = record  # this save's measurements (bytes, stall, persist, commit latency)
        self.stall_s = record.stall_s  # how long save() blocked the caller
        self.status = SaveStatus.PENDING
        self.error: SaveFailedError | None = None
        self.warnings: list[str] = []  # what the commit noticed (e.g. ranks' common state differed)
        self.finished_s: float | None = None
        self._observed = False
        self._started_s = time.monotonic()

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, status={self.status.value})"

    @property
    def committed(self) -> bool:
        return self.status is SaveStatus.COMMITTED

    @property
    def skipped(self) -> bool:
        return self.status is SaveStatus.SKIPPED

    def done(self) -> bool:
        """True once the save committed, failed or was skipped (never blocks)."""
        if self.status is SaveStatus.PENDING:
            self._owner._pump_quietly()
        return self.status is not SaveStatus.PENDING

    def wait(self, timeout_s: float | None = None) -> Location:
        """Block until committed and return the checkpoint directory; raise the save's error.

        Raises :class:`SaveFailedError` (with every known reason) if the save aborted,
        :class:`SaveSkippedError` if it was skipped, :class:`SaveTimeoutError` after ``timeout_s``
        (default: the config's ``commit_timeout_s`` plus a margin) while still pending.
        """
        self._owner._wait_for(self, timeout_s)
        self._observed = True
        if self.status is SaveStatus.COMMITTED:
            return self.path
        if self.error is not None:
            raise self.error
        raise SaveTimeoutError(
            f"step {self.step} did not commit within the wait timeout; it may "
            "still commit later (check handle.done() or Checkpointer.latest())"
        )

    def _resolve(self, status: SaveStatus, error: SaveFailedError | None = None) -> None:
        if self.status is not SaveStatus.PENDING:
            return
        self.status = status
        self.error = error
        self.finished_s = time.monotonic() - self._started_s
        if status is SaveStatus.COMMITTED:
            self.record.commit_latency_s = self.finished_s
        self._stats.finished(self.record, status.value)
        if status is SaveStatus.SKIPPED:
            self._observed = True  # the policy's choice, logged: not an error to re-raise later


__all__ = ["SaveHandle", "SaveStatus", "SaveFailedError", "SaveSkippedError"]


def daemon_lost_reason(reason: str, step: int, path: Location) -> str:
    """Why a pending save of ``step`` fails when its node daemon is lost (``reason``), as far as
    this rank can know: a daemon that is also the coordinator may have died after the commit's
    rename (the point of no return: the next coordinator makes that checkpoint latest), so the
    committed directory ``path`` is looked at before anything is said about the outcome."""
    if _in_place(path):
        return (
            f"{reason} before confirming step {step}, but its checkpoint {path} is complete: the "
            "commit had renamed it into place, and the next daemon makes it latest "
            "(Checkpointer.latest() tells)"
        )
    return (
        f"{reason} before confirming step {step}; its checkpoint {path} is not in place now, so it "
        "did not commit unless the job's coordinator on another node still completes it "
        "(Checkpointer.latest() tells)"
    )


def _in_place(path: Location) -> bool:
    """The step's checkpoint is complete where it commits (on S3: its commit object exists)."""
    if isinstance(path, S3Location):
        try:
            return checkpoint_exists(path)
        except CkptdError:  # the store is unreachable too: say what is known, not in place
            return False
    return is_real_dir(path) and is_checkpoint_dir(path)
