"""The handle an asynchronous save returns (poll it, wait for it, read its outcome), and the
future it resolves through."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from ..errors import SaveFailedError, SaveSkippedError, SaveTimeoutError
from ..storage.url import Location
from .stats import SaveRecord, SaveStats


class SaveStatus(str, enum.Enum):
    PENDING = "pending"  # handed to the daemon, not committed yet
    COMMITTED = "committed"  # durable, and named by the tracker unless a newer step is
    # Failed somewhere (reason in ``error``): nothing of it is visible. Or, when the error says
    # "was not confirmed", its outcome never reached this rank (its daemon was lost, or the
    # Checkpointer closed first): it may commit all the same, as the error says.
    ABORTED = "aborted"
    SKIPPED = "skipped"  # the on_full="skip" policy dropped the step, on this rank or another


class SaveFuture:
    """One save's outcome as its rank learns it: PENDING until :meth:`set_result` sets it, once.

    The owning Checkpointer drives it: ``poll()`` delivers the notifications that arrived (never
    blocks), ``wait(future, timeout_s)`` delivers them until the future is resolved or the timeout
    passed; the notifications resolve it through the rank's pending saves (ckptd.client.pending).
    It also finishes the save's :class:`SaveRecord` in ``stats``.
    """

    def __init__(
        self,
        step: int,
        record: SaveRecord,
        stats: SaveStats,
        poll: Callable[[], None],
        wait: Callable[[SaveFuture, float | None], None],
    ) -> None:
        self.step = step
        self.record = record
        self.status = SaveStatus.PENDING
        self.error: SaveFailedError | None = None
        self.finished_s: float | None = None
        self.observed = False  # the outcome reached the caller: a failure is not raised again later
        self._stats = stats
        self._poll = poll
        self._wait = wait
        self._started_s = time.monotonic()

    def done(self) -> bool:
        if self.status is SaveStatus.PENDING:
            self._poll()
        return self.status is not SaveStatus.PENDING

    def wait(self, timeout_s: float | None) -> None:
        """Return once resolved, or after ``timeout_s`` (None: the owner's default) still pending."""
        self._wait(self, timeout_s)

    def set_result(self, status: SaveStatus, error: SaveFailedError | None = None) -> None:
        if self.status is not SaveStatus.PENDING:
            return
        self.status = status
        self.error = error
        self.finished_s = time.monotonic() - self._started_s
        if status is SaveStatus.COMMITTED:
            self.record.commit_latency_s = self.finished_s
        self._stats.finished(self.record, status.value)
        if status is SaveStatus.SKIPPED:
            self.observed = True  # the policy's choice, logged: not an error to re-raise later


class SaveHandle:
    """One rank's view of one asynchronous save. Use on the thread that owns the Checkpointer."""

    def __init__(self, future: SaveFuture, path: Location, attempt: str = "") -> None:
        self.future = future
        self.step = future.step
        self.attempt = attempt  # this try's attempt id (ckptd.control.attempt)
        self.path = path  # the committed directory or s3:// prefix (exists once COMMITTED)
        self.record = future.record  # this save's measurements (bytes, stall, persist, commit latency)
        self.stall_s = self.record.stall_s  # how long save() blocked the caller
        self.warnings: list[str] = []  # what the commit noticed (e.g. ranks' common state differed)

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, status={self.status.value})"

    @property
    def status(self) -> SaveStatus:
        return self.future.status

    @property
    def error(self) -> SaveFailedError | None:
        """Why the save aborted or was skipped (None while pending or once committed)."""
        return self.future.error

    @property
    def finished_s(self) -> float | None:
        """Seconds from ``save()`` returning to the outcome (None while pending)."""
        return self.future.finished_s

    @property
    def committed(self) -> bool:
        return self.status is SaveStatus.COMMITTED

    @property
    def skipped(self) -> bool:
        return self.status is SaveStatus.SKIPPED

    def done(self) -> bool:
        """True once the save committed, failed or was skipped (never blocks)."""
        return self.future.done()

    def wait(self, timeout_s: float | None = None) -> Location:
        """Block until committed and return the checkpoint directory; raise the save's error.

        Raises :class:`SaveFailedError` (with every known reason) if the save aborted,
        :class:`SaveSkippedError` if it was skipped, :class:`SaveTimeoutError` after ``timeout_s``
        (default: the config's ``commit_timeout_s`` plus a margin) while still pending.
        """
        self.future.wait(timeout_s)
        # A wait that timed out observed nothing: a failure that comes later is raised by the next
        # save(), wait_all() or close() unless a wait sees it first.
        self.future.observed = self.status is not SaveStatus.PENDING
        if self.status is SaveStatus.COMMITTED:
            return self.path
        if self.error is not None:
            raise self.error
        raise SaveTimeoutError(
            f"step {self.step} did not commit within the wait timeout; it may "
            "still commit later (check handle.done() or Checkpointer.latest())"
        )


__all__ = ["SaveFuture", "SaveHandle", "SaveStatus", "SaveFailedError", "SaveSkippedError"]
