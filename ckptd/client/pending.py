"""A rank's saves the daemon took and has not resolved yet, and how its notifications resolve them.

:class:`PendingSaves` holds one :class:`~ckptd.client.handle.SaveHandle` per step in flight and
the failed ones nobody observed yet. The Checkpointer hands it the daemon's notifications
(``WRITE_DONE``, ``STEP_COMMITTED``, ``STEP_ABORTED``) and the failures it learns itself (its
daemon lost, closing); each resolves the handle's future once. Outcomes of other attempts of a
step never resolve its handle.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from ..catalog import abandoned_commit, is_checkpoint_dir
from ..control.protocol import StepAborted, StepCommitted, WriteDone
from ..errors import CkptdError, SaveFailedError, SaveSkippedError, SaveTimeoutError
from ..format.commitrecord import read_commit_record
from ..format.safefs import is_real_dir
from ..statedict.holdings import PlainWriters
from ..storage.url import Location, S3Location
from .handle import SaveHandle, SaveStatus

log = logging.getLogger(__name__)


class PendingSaves:
    """This rank's handles in flight, by step, and the failures not observed yet."""

    def __init__(self, rank: int, plain: PlainWriters, committed: Callable[[str], None] | None = None) -> None:
        self.rank = rank
        self._plain = plain  # told which steps committed or failed (ckptd.statedict.holdings)
        self._on_committed = committed  # told the name of each step directory committed
        self._by_step: dict[int, SaveHandle] = {}
        self._unobserved: list[SaveHandle] = []

    def __contains__(self, step: int) -> bool:
        return step in self._by_step

    def __bool__(self) -> bool:
        return bool(self._by_step)

    def handles(self) -> list[SaveHandle]:
        """The pending handles, by step."""
        return sorted(self._by_step.values(), key=lambda h: h.step)

    def add(self, handle: SaveHandle) -> None:
        self._by_step[handle.step] = handle

    def wrote(self, msg: WriteDone) -> None:
        """The daemon wrote this rank's file of a save: note its timings on the handle."""
        h = self._by_step.get(msg.step)
        if h is not None and h.attempt == msg.attempt:
            h.record.persist_s, h.record.write_queue_s = msg.write_s, msg.queue_s
            h.record.snapshot_s = msg.snapshot_s

    def resolve(self, msg: StepCommitted | StepAborted) -> None:
        """A step's verdict: resolve its handle when it is about this rank's attempt."""
        h = self._by_step.get(msg.step)
        if h is None or h.attempt != msg.attempt:
            log.debug(
                "rank %d: %s of step %d attempt %s, which this rank is not waiting for",
                self.rank,
                msg.TYPE.name,
                msg.step,
                msg.attempt,
            )
        elif isinstance(msg, StepCommitted):
            self._committed(h, msg)
        elif msg.skipped:
            self._skipped_elsewhere(h, msg.reason)
        else:
            self.fail(h, msg.reason)

    def _committed(self, h: SaveHandle, msg: StepCommitted) -> None:
        del self._by_step[msg.step]
        self._plain.committed(msg.step, msg.plain_digest)
        if self._on_committed is not None:
            self._on_committed(msg.name)
        for warning in msg.warnings:
            log.warning("rank %d: %s", self.rank, warning)
        h.warnings = list(msg.warnings)
        h.future.set_result(SaveStatus.COMMITTED)
        r = h.record
        log.info(
            "rank %d: step %d committed as %s: %d bytes, stall %.3f s, persist %s s, "
            "committed %.3f s after save() returned",
            self.rank,
            msg.step,
            msg.name,
            r.nbytes,
            r.stall_s,
            "?" if r.persist_s is None else f"{r.persist_s:.3f}",
            r.commit_latency_s or 0.0,
        )

    def fail(self, h: SaveHandle, reason: str, *, unconfirmed: bool = False) -> None:
        """Abort ``h``, a failure the next call raises unless a wait() saw it; ``unconfirmed``:
        nobody can say it did not commit (its daemon was lost)."""
        self._abort(h, reason, unconfirmed=unconfirmed)
        self._unobserved.append(h)

    def _abort(self, h: SaveHandle, reason: str, *, unconfirmed: bool) -> None:
        self._by_step.pop(h.step, None)
        self._plain.failed(h.step)  # the next saves write every plain item they hold
        what = "was not confirmed" if unconfirmed else "was not committed"
        h.future.set_result(SaveStatus.ABORTED, SaveFailedError(f"step {h.step} {what}: {reason}"))
        log.warning("rank %d: step %d %s: %s", self.rank, h.step, what, reason)

    def closed(self) -> None:
        """The Checkpointer closes with these saves pending. The daemon took each (a handle is
        pending only once its SAVE_ACK came) and decides it without this rank: it commits unless
        it fails there. So each resolves as unconfirmed (ABORTED, the error saying how to learn
        the outcome), no failure: no later call raises it, only its own ``wait()``."""
        for h in list(self._by_step.values()):
            self._abort(h, closed_reason(h.step, h.path), unconfirmed=True)

    def daemon_lost(self, reason: str) -> list[tuple[int, str]]:
        """The node daemon was lost (``reason``): fail every pending save with what is known of it.
        Returns the (step, attempt) of each, oldest step first."""
        lost = sorted(self._by_step.values(), key=lambda h: h.step)
        for h in lost:
            self.fail(h, daemon_lost_reason(reason, h.step, h.path, h.attempt), unconfirmed=True)
        return [(h.step, h.attempt) for h in lost]

    def _skipped_elsewhere(self, h: SaveHandle, reason: str) -> None:
        """Another rank skipped this step by policy (on_full="skip"): the step is aborted on every
        rank, and this rank's save of it resolves as SKIPPED, as the skipping rank's own does: the
        policy's choice, never raised by a later call (only ``wait()`` raises SaveSkippedError)."""
        self._by_step.pop(h.step, None)
        h.future.set_result(SaveStatus.SKIPPED, SaveSkippedError(f"step {h.step} was skipped: {reason}"))
        log.warning("rank %d: step %d skipped: %s", self.rank, h.step, reason)

    def raise_unobserved(self) -> None:
        """Raise the failures of earlier saves nobody observed (each once)."""
        failed = [h for h in self._unobserved if not h.future.observed]
        self._unobserved.clear()
        if failed:
            for h in failed:
                h.future.observed = True
            detail = "; ".join(str(h.error) for h in failed)
            raise SaveFailedError(f"{len(failed)} earlier asynchronous save(s) failed: {detail}")


def daemon_lost_reason(reason: str, step: int, path: Location, attempt: str = "") -> str:
    """Why a pending save of ``step`` (``attempt``) fails when its node daemon is lost
    (``reason``), as far as this rank can know: a daemon that is also the coordinator may have died
    after the commit's rename (the point of no return: the next coordinator makes that checkpoint
    latest), so the committed directory ``path`` is looked at before anything is said about the
    outcome; one its commit record names another attempt of (a branch a rollback abandoned) is not
    this save's. An ``s3://`` step is not looked at: this runs inside save() and done(), where a
    round trip to the store per pending save (each up to the store's request timeout) is no place."""
    looked = _in_place(path, step, attempt)
    if looked is None:
        return (
            f"{reason} before confirming step {step}; whether its checkpoint {path} committed is not "
            "known here: the next daemon makes it latest if it did (Checkpointer.latest() tells)"
        )
    if looked:
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


def closed_reason(step: int, path: Location) -> str:
    """Why a save of ``step`` still pending when its Checkpointer closed resolves unconfirmed."""
    return (
        f"the Checkpointer was closed before step {step} committed; the node daemon had taken the "
        "save and still commits it unless it fails there (or close() stopped its snapshot producer at "
        f"its timeout, logged). Whether {path} committed: `ckptd ls` of the root, "
        "Checkpointer.latest(), or the step the next resume() loads"
    )


def _in_place(path: Location, step: int, attempt: str) -> bool | None:
    """Whether the step's checkpoint directory is complete, and its commit record (if any) names
    ``attempt`` on the current branch (an abandoned commit of the step may carry the same attempt
    id: a repeated ``CKPTD_RUN_ID``). None: not known (an ``s3://`` step, or the root could not be
    read: every pending save is failed all the same)."""
    if isinstance(path, S3Location):
        return None
    try:
        if not (is_real_dir(path) and is_checkpoint_dir(path)):
            return False
        local = read_commit_record(path)
        if local is None:
            return True
        return (not attempt or local.attempt == attempt) and not abandoned_commit(path.parent, step, local.seq)
    except (OSError, CkptdError) as exc:
        log.warning("could not look whether %s is in place: %s", path, exc)
        return None


def wait_for_all(handles: list[SaveHandle], timeout_s: float | None) -> None:
    """Wait for every one of ``handles``, ``timeout_s`` in all; raise the first failure (after
    all finished; a skipped save is no failure), or SaveTimeoutError when some are still pending
    at the timeout."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    first: SaveFailedError | None = None
    timed_out: SaveTimeoutError | None = None
    for h in handles:
        try:
            h.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except SaveSkippedError:
            pass
        except SaveFailedError as exc:
            first = first or exc
        except SaveTimeoutError as exc:  # the others are still looked at: a failure among them wins
            timed_out = timed_out or exc
    if first is not None:
        raise first
    if timed_out is not None:
        raise timed_out


def settle_above(handles: list[SaveHandle], step: int, timeout_s: float) -> None:
    """Wait, ``timeout_s`` in all, for those of ``handles`` saving a step above ``step``: before a
    load of ``step`` (ckptd.catalog.WentBack: one committed after the load passes for the new
    branch's, and its step is refused when saved again). Their failures stay for the next call,
    as any save's; one still pending then is left to it (a lazy save of ranks that do not reach
    their fence while this rank loads would hold it)."""
    deadline = time.monotonic() + timeout_s
    for h in handles:
        if h.step > step:  # the future's wait: the handle's would mark a failure observed
            with contextlib.suppress(CkptdError):
                h.future.wait(max(0.0, deadline - time.monotonic()))
