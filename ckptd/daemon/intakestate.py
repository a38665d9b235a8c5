"""The node daemon's decisions on the saves it took, as a pure state machine.

:class:`IntakeState` decides, from events and the time, what happens to each save after
:class:`~ckptd.daemon.intake.SaveIntake` checked its SAVE and took it (its write queued behind the
ring's earlier writes once the rank was answered); the intake executes the actions (hands writes
to writer threads, sends WRITE_DONE to the rank, reports to the coordinator through the uplink).
Its only other input is the uplink's own state machine
(:class:`~ckptd.daemon.uplinkstate.UplinkState`), read for the verdict on an attempt and for whether
a rank still waits for one. Nothing here touches a socket, a thread, the clock or a file
(tools/import_graph.py checks it), so each rule is tested in milliseconds
(tests/unit/test_intake_state.py); the process tests keep the wiring.

The rules, in the order of a save:

1. :class:`Taken`: the save's write is unfinished from now on (its timeout counts from here).
2. :class:`Ready` (the ring's earlier writes are done): the write starts (:class:`StartWrite`),
   unless its attempt was aborted meanwhile (another rank skipped or failed the step): then the
   writer only drains the ring as the producer goes and writes nothing.
3. :class:`Ended`: the rank is told its block and ring space are free (:class:`TellRank`), then the
   coordinator gets WRITTEN, or FAILED: for a failed write, and for a write that ended after its
   attempt was decided (a late write: its files are removed by the coordinator). A drained save
   (:class:`NotWritten`) reports nothing: the rank knows the verdict.
4. :class:`Tick`: a write not ended ``commit_timeout_s`` after it was taken is reported FAILED at
   once, once, unless its attempt was decided: the coordinator learns of a step only from a
   report, so a disk that hangs before any write of a step ends would otherwise never abort it.
   The write goes on (a thread blocked in the kernel cannot be stopped); its end is step 3.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import CkptdConfig
from ..control.protocol import AttemptInFlight, Failed, StepAborted, Written
from ..control.wiretext import bounded_text
from ..errors import CkptdError
from ..format.records import ItemRecord
from .uplinkstate import StepKey, UplinkState

if TYPE_CHECKING:
    from .workers import WriteRequest

log = logging.getLogger(__name__)


class NotWritten(CkptdError):
    """A save whose attempt was decided before its write started: drained, nothing written."""


@dataclass(frozen=True, kw_only=True)
class WriteJob:
    """A SAVE the daemon took: what its writer writes and where the outcome goes."""

    request: WriteRequest
    attempt: str
    world_size: int
    generation: str
    block: int
    identity: bytes  # the rank's connection
    common_digest: str
    plain_digest: str = ""  # of the rank's plain keys (ckptd.statedict.holdings)
    held: tuple[str, ...] = ()  # keys the rank holds without storing them (ckptd.format.coverage)
    report_id: int = 0  # which save of the rank this is: its seal, as a number (Written.report_id)
    went_back: tuple[int, float] = (-1, 0.0)  # the SAVE's went_back_to and went_back_unix_s

    @property
    def key(self) -> StepKey:
        return (self.request.step, self.attempt)

    @property
    def slot(self) -> tuple[str, int]:
        """The ring control block it holds: one unfinished write per block."""
        return (self.generation, self.block)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.request.placements)

    def __repr__(self) -> str:  # logged when a write fails: never the common state's bytes
        return f"step {self.request.step} attempt {self.attempt} rank {self.request.rank}"


@dataclass(frozen=True, kw_only=True)
class WriteResult:
    """What a finished write hands back to the loop."""

    stored: list[ItemRecord] = field(default_factory=list)  # the records as stored in the data file
    file_nbytes: int = 0  # the data file's size (the coordinator checks it before the commit)
    queue_s: float = 0.0  # waiting for a writer thread
    write_s: float = 0.0  # writing and fsyncing, minus the time spent waiting for the producer
    snapshot_s: float = 0.0  # waiting for the producer (fork child, copier) to produce items
    disk_seq: int = 0  # node-local roots: the disk's highest commit number (Written.disk_seq)


# --- events ------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Taken:
    job: WriteJob


@dataclass(frozen=True, kw_only=True)
class Ready:
    """The ring's earlier writes are done: ``job``'s may start."""

    job: WriteJob


@dataclass(frozen=True, kw_only=True)
class Ended:
    """``job``'s writer thread ended: ``result``, or ``error`` (``reason``: it as one line)."""

    job: WriteJob
    result: WriteResult | None = None
    error: Exception | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Time passed: the write timeouts."""


Event = Taken | Ready | Ended | Tick


# --- actions -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StartWrite:
    """Hand ``job`` to a writer thread; ``drain``: write nothing, only free the ring space as the
    producer goes (its attempt was aborted before the write started)."""

    job: WriteJob
    drain: bool


@dataclass(frozen=True, kw_only=True)
class TellRank:
    """WRITE_DONE to ``job``'s rank: its block and ring space are free again."""

    job: WriteJob
    result: WriteResult


@dataclass(frozen=True, kw_only=True)
class Report:
    """WRITTEN/FAILED of attempt ``key`` to the coordinator (through the uplink)."""

    key: StepKey
    msg: Written | Failed


Action = StartWrite | TellRank | Report


class IntakeState:
    """The saves this node took and not finished yet; see the module docstring for the rules.

    ``data_file``: where a rank's data file of an attempt is, as ``(step, attempt, rank) -> str``
    (for the timeout's reason; the root store's display, which reads nothing)."""

    def __init__(
        self, config: CkptdConfig, uplink: UplinkState, *, node: int, data_file: Callable[[int, str, int], str]
    ) -> None:
        self.config = config
        self.uplink = uplink
        self.node = node
        self.data_file = data_file
        self.unfinished: dict[tuple[str, int], tuple[WriteJob, float]] = {}  # by slot: (job, taken at)

    def in_use(self, rank: int, key: StepKey) -> bool:
        """Whether a save of ``rank`` under attempt ``key`` is unfinished here: still being written,
        or reported and awaiting its verdict (a second save under that attempt id would write the
        same data file, and be answered by the same verdict)."""
        if any(job.key == key and job.request.rank == rank for job, _ in self.unfinished.values()):
            return True
        return self.uplink.reported(key, rank)

    def in_flight(self, alive: Callable[[bytes], bool]) -> list[AttemptInFlight]:
        """The attempts this node holds undecided (an IN_FLIGHT's answer): its writes not ended
        and its reports awaiting their verdict, by attempt, in step order; ``alive``: whether the
        rank connected as an identity is still connected and running."""
        ranks: dict[StepKey, tuple[set[int], set[int], set[int]]] = {}
        world: dict[StepKey, int] = {}
        savers: dict[StepKey, set[bytes]] = {}

        def note(key: StepKey, rank: int, world_size: int, kind: int) -> None:
            ranks.setdefault(key, (set(), set(), set()))[kind].add(rank)
            world[key] = max(world.get(key, 0), world_size)

        for job, _ in self.unfinished.values():
            if self.uplink.undecided(job.key):
                note(job.key, job.request.rank, job.world_size, 0)
                savers.setdefault(job.key, set()).add(job.identity)
        for key, reports, notify in self.uplink.open_attempts():
            for msg in reports:
                note(key, msg.rank, msg.world_size, 1 if isinstance(msg, Written) else 2)
            savers.setdefault(key, set()).update(notify)
        return [
            AttemptInFlight(
                step=step,
                attempt=attempt,
                world_size=world[(step, attempt)],
                writing=tuple(sorted(writing)),
                written=tuple(sorted(written)),
                failed=tuple(sorted(failed)),
                live=any(alive(identity) for identity in savers.get((step, attempt), ())),
            )
            for (step, attempt), (writing, written, failed) in sorted(ranks.items())
        ]

    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply ``event`` at time ``now``; the actions to execute, in order."""
        if isinstance(event, Taken):
            self.unfinished[event.job.slot] = (event.job, now)
            return []
        if isinstance(event, Ready):
            aborted = isinstance(self.uplink.verdict(event.job.key), StepAborted)
            return [StartWrite(job=event.job, drain=aborted)]
        if isinstance(event, Ended):
            return self._ended(event)
        return self._overdue(now)

    def _ended(self, event: Ended) -> list[Action]:
        job = event.job
        self.unfinished.pop(job.slot, None)
        result = event.result if event.error is None and event.result is not None else WriteResult()
        out: list[Action] = [TellRank(job=job, result=result)]
        if isinstance(event.error, NotWritten):  # drained: the rank knows the verdict
            return out
        if event.error is None and self.uplink.expects(job.key, job.identity):
            out.append(Report(key=job.key, msg=self._written(job, result)))
            return out
        why = (
            f"writing its data file failed: {event.reason}"
            if event.error is not None
            else "its data file was written after the attempt had been decided (late write)"
        )
        out.append(Report(key=job.key, msg=self._failed(job, why)))
        return out

    def _overdue(self, now: float) -> list[Action]:
        limit_s = self.config.commit_timeout_s
        out: list[Action] = []
        for slot, (job, taken_s) in list(self.unfinished.items()):
            if now - taken_s <= limit_s:
                continue
            del self.unfinished[slot]
            if not self.uplink.expects(job.key, job.identity):
                continue  # decided already (another rank failed it, say)
            req = job.request
            why = (
                f"its data file {self.data_file(req.step, job.attempt, req.rank)} was not written within "
                f"{limit_s:g} s of its SAVE (CKPTD_COMMIT_TIMEOUT_S): the storage hangs or is too slow "
                "(raise the timeout if it is only slow); the write goes on, and its files are removed "
                "once it ends"
            )
            log.warning("step %d attempt %s rank %d: %s", req.step, job.attempt, req.rank, why)
            out.append(Report(key=job.key, msg=self._failed(job, why)))
        return out

    def _written(self, job: WriteJob, result: WriteResult) -> Written:
        req = job.request
        return Written(
            step=req.step,
            attempt=job.attempt,
            rank=req.rank,
            world_size=job.world_size,
            node=self.node,
            records=list(result.stored),
            common=req.common,
            common_digest=job.common_digest,
            file_nbytes=result.file_nbytes,
            plain_digest=job.plain_digest,
            held=list(job.held),
            report_id=job.report_id,
            disk_seq=result.disk_seq,
            went_back_to=job.went_back[0],
            went_back_unix_s=job.went_back[1],
        )

    def _failed(self, job: WriteJob, reason: str) -> Failed:
        req = job.request
        return Failed(
            step=req.step,
            attempt=job.attempt,
            rank=req.rank,
            world_size=job.world_size,
            node=self.node,
            reason=bounded_text(reason),  # (an OS error's text, a file name: it must fit the message)
        )
