"""The node daemon's save path: a rank's SAVE in, its data file written, the outcome reported.

Order of one save, all on the daemon's loop except step 3:

1. :meth:`SaveIntake.take` checks a SAVE against the rank's ring (its control block, ring range,
   records and producer), binds it to the attempt's directory ``<step>.<attempt>.tmp/`` and
   queues the write behind the ring's earlier ones; the rank is then acknowledged and owns
   nothing any more;
2. once the ring's previous write finished, the write goes to a writer thread; if its attempt
   was aborted meanwhile (another rank skipped or failed the step), nothing is written: the
   writer only frees the save's ring space as the producer goes (:meth:`SaveIntake._drain`);
3. the writer thread writes the rank's data file into the root (ckptd.roots: a file of the
   attempt's directory, or an object) from the ring as the producer fills it
   (ckptd.daemon.workers.write_rank_file) and makes it durable;
4. :meth:`SaveIntake.on_done`: the block is free (``WRITE_DONE`` to the rank), and ``WRITTEN``
   (or ``FAILED``) goes to the coordinator. A write that finished after its attempt was decided
   is reported as FAILED, never WRITTEN.

A write not finished ``commit_timeout_s`` after its SAVE was taken (queued, waiting for its
producer, or writing) is reported as ``FAILED`` at once by :meth:`SaveIntake.tick`: the coordinator
learns of a step only from a report, so a disk that hangs before any write of a step completes
would otherwise never abort it. The write itself goes on (a thread blocked in the kernel cannot be
stopped); when it ends, step 4 reports it as a late write and its directory is removed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import CkptdConfig
from ..control.endpoints import Endpoints
from ..control.protocol import Failed, Message, Save, StepAborted, WriteDone, Written
from ..errors import CkptdError, ProtocolError, StagingError
from ..format.records import ItemRecord
from ..format.rootlayout import tmp_dir_name
from ..roots.base import RootStore
from ..staging.ring import ALIGN, Placement
from .metrics import DaemonMetrics
from .rings import DaemonRing, RingTable
from .snapshot import SnapshotWait, check_snapshot_child
from .uplink import CoordinatorLink
from .workers import WorkerPools, WriteFinished, WriteRequest, write_rank_file

log = logging.getLogger(__name__)

_MAX_RING_OFFSET = 1 << 62


class NotWritten(CkptdError):
    """A save whose attempt was decided before its write started (ckptd.daemon.intake._drain)."""


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

    @property
    def key(self) -> tuple[int, str]:
        return (self.request.step, self.attempt)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.request.placements)

    def __repr__(self) -> str:  # logged when a write fails: never the common state's bytes
        return f"step {self.request.step} attempt {self.attempt} rank {self.request.rank}"


@dataclass(frozen=True, kw_only=True)
class WriteResult:
    """What a finished write hands back to the loop."""

    stored: list[ItemRecord]  # the records as stored in the data file
    file_nbytes: int  # the data file's size (the coordinator checks it before the commit)
    queue_s: float  # waiting for a writer thread
    write_s: float  # writing and fsyncing, minus the time spent waiting for the producer
    snapshot_s: float  # waiting for the producer (fork child, copier) to produce items


class SaveIntake:
    def __init__(
        self,
        ep: Endpoints,
        config: CkptdConfig,
        rings: RingTable,
        workers: WorkerPools,
        metrics: DaemonMetrics,
        uplink: CoordinatorLink,
        store: RootStore,
        send_to_rank: Callable[[Message, bytes], None],
    ) -> None:
        self.ep = ep
        self.config = config
        self.rings = rings
        self.workers = workers
        self.metrics = metrics
        self.uplink = uplink
        self.store = store
        self.send_to_rank = send_to_rank
        # Writes not finished yet, by (generation, block): (the job, when its SAVE was taken).
        self.unfinished: dict[tuple[str, int], tuple[WriteJob, float]] = {}

    def take(self, identity: bytes, rank_pid: int, msg: Save) -> None:
        """Check a SAVE of the rank connected as ``identity`` (process ``rank_pid``) and queue its
        write; raises (StagingError, ProtocolError) when the request cannot be served."""
        ring = self.rings.get(msg.rank, msg.generation, identity)
        ring.check_block(msg.block)
        if not 0 <= msg.ring_start < _MAX_RING_OFFSET or msg.ring_start % ALIGN:
            raise StagingError(f"rank {msg.rank}: ring start {msg.ring_start} is not an aligned offset")
        records, placements, held = self._items(msg, ring)
        check_snapshot_child(msg.rank, msg.snapshot_pid, rank_pid, ring.registered_s)
        producer = SnapshotWait.open(msg.rank, msg.snapshot_pid, msg.seal, msg.seal_offset)
        ring.take_block(msg.block)
        job = WriteJob(
            request=WriteRequest(
                step=msg.step,
                rank=msg.rank,
                records=records,
                placements=placements,
                common=msg.common,
                ring_start=msg.ring_start,
            ),
            attempt=msg.attempt,
            world_size=msg.world_size,
            generation=msg.generation,
            block=msg.block,
            identity=identity,
            common_digest=msg.common_digest,
            plain_digest=msg.plain_digest,
            held=tuple(held),
        )
        ring.queue_write(lambda: self._start_write(job, ring, producer))
        self.metrics.save_received(msg.step)
        self.uplink.expect(job.key, identity)
        self.unfinished[(job.generation, job.block)] = (job, time.monotonic())
        log.info(
            "step %d attempt %s rank %d: %d items queued from ring offset %d",
            msg.step,
            msg.attempt,
            msg.rank,
            len(records),
            msg.ring_start,
        )

    def _start_write(self, job: WriteJob, ring: DaemonRing, producer: SnapshotWait) -> None:
        """Hand ``job`` to a writer thread (the ring's earlier writes are done)."""
        aborted = isinstance(self.uplink.verdict(job.key), StepAborted)
        self.workers.write(job, self._drain(job, ring, producer) if aborted else self._writer(job, ring, producer))

    def _drain(self, job: WriteJob, ring: DaemonRing, producer: SnapshotWait) -> Callable[[], WriteResult]:
        """The writer thread's work for a save whose attempt aborted before its write started:
        write nothing (behind a slow disk, a doomed write would hold the ring and make the
        rank's next saves wait or skip), only free the ring space as the producer goes."""
        timeout_s = self.config.snapshot_timeout_s

        def run() -> WriteResult:
            try:
                producer.drain(ring.map, job.request.ring_end, timeout_s)
            finally:
                producer.close()
            raise NotWritten(f"{job!r}: the attempt was aborted before its write started; nothing written")

        return run

    def _writer(self, job: WriteJob, ring: DaemonRing, producer: SnapshotWait) -> Callable[[], WriteResult]:
        """The writer thread's work for ``job`` (its errors fail the save)."""
        req = job.request
        target = self.store.data_target(req.step, job.attempt, req.rank)  # created by the writer
        cfg, rmap, queued_s = self.config, ring.map, time.monotonic()

        def run() -> WriteResult:
            started_s = time.monotonic()
            stored, file_nbytes = write_rank_file(target, rmap, req, cfg.checksums, producer, cfg.snapshot_timeout_s)
            # The write overlaps the producer's copy; the time it only waited is reported apart.
            write_s = time.monotonic() - started_s - producer.waited_s
            return WriteResult(
                stored=stored,
                file_nbytes=file_nbytes,
                queue_s=started_s - queued_s,
                write_s=write_s,
                snapshot_s=producer.waited_s,
            )

        return run

    def _items(self, msg: Save, ring: DaemonRing) -> tuple[list[ItemRecord], list[Placement], list[str]]:
        """The SAVE's records, placements and held keys: sent, or the rank's unchanged layout it
        names."""
        if msg.layout and not msg.items:
            if ring.layout is None or ring.layout[0] != msg.layout:
                raise ProtocolError(
                    f"rank {msg.rank}: SAVE names item layout {msg.layout!r}, which this "
                    "daemon does not hold; send the items"
                )
            return ring.layout[1], ring.layout[2], ring.layout[3]
        records, placements = decode_items(msg, ring.capacity)
        if msg.layout:
            ring.layout = (msg.layout, records, placements, msg.held)
        return records, placements, msg.held

    def on_done(self, done: WriteFinished) -> None:
        """A write finished: free its block, tell the rank, report to the coordinator."""
        job: WriteJob = done.job
        req = job.request
        self.unfinished.pop((job.generation, job.block), None)
        self.rings.write_done(req.rank, job.generation, job.block)
        if isinstance(done.error, NotWritten):  # the rank knows the verdict; nothing to report
            log.info("%s", done.error)
            self.send_to_rank(
                WriteDone(
                    generation=job.generation,
                    block=job.block,
                    step=req.step,
                    attempt=job.attempt,
                    write_s=0.0,
                    queue_s=0.0,
                    snapshot_s=0.0,
                ),
                job.identity,
            )
            return
        result: WriteResult = (
            done.result
            if done.error is None
            else WriteResult(stored=[], file_nbytes=0, queue_s=0.0, write_s=0.0, snapshot_s=0.0)
        )
        self.metrics.write_finished(req.step, job.nbytes, result.write_s, result.queue_s, ok=done.error is None)
        self.send_to_rank(
            WriteDone(
                generation=job.generation,
                block=job.block,
                step=req.step,
                attempt=job.attempt,
                write_s=result.write_s,
                queue_s=result.queue_s,
                snapshot_s=result.snapshot_s,
            ),
            job.identity,
        )
        if done.error is None and self.uplink.expects(job.key, job.identity):
            self.uplink.report(
                Written(
                    step=req.step,
                    attempt=job.attempt,
                    rank=req.rank,
                    world_size=job.world_size,
                    node=self.ep.node,
                    records=[r.to_wire() for r in result.stored],
                    common=req.common,
                    common_digest=job.common_digest,
                    file_nbytes=result.file_nbytes,
                    plain_digest=job.plain_digest,
                    held=list(job.held),
                ),
                job.key,
            )
            return
        # The coordinator answers a report of a decided attempt with its outcome and removes the
        # directory the late write re-created.
        why = (
            f"writing its data file failed: {done.reason}"
            if done.error is not None
            else "its data file was written after the attempt had been decided (late write)"
        )
        self.uplink.report(
            Failed(
                step=req.step,
                attempt=job.attempt,
                rank=req.rank,
                world_size=job.world_size,
                node=self.ep.node,
                reason=why,
            ),
            job.key,
        )

    def tick(self, now: float) -> None:
        """Report as FAILED each write not finished ``commit_timeout_s`` after its SAVE was taken
        (see the module docstring), once."""
        limit_s = self.config.commit_timeout_s
        for slot, (job, taken_s) in list(self.unfinished.items()):
            if now - taken_s <= limit_s:
                continue
            del self.unfinished[slot]
            if not self.uplink.expects(job.key, job.identity):
                continue  # decided already (another rank failed it, say)
            req = job.request
            name = self.store.data_file_name(job.attempt, req.rank)
            why = (
                f"its data file {self.store.display(tmp_dir_name(req.step, job.attempt), name)} was "
                f"not written within {limit_s:g} s of its SAVE (CKPTD_COMMIT_TIMEOUT_S): the storage hangs "
                "or is too slow (raise the timeout if it is only slow); the write goes on, and its files "
                "are removed once it ends"
            )
            log.warning("step %d attempt %s rank %d: %s", req.step, job.attempt, req.rank, why)
            self.uplink.report(
                Failed(
                    step=req.step,
                    attempt=job.attempt,
                    rank=req.rank,
                    world_size=job.world_size,
                    node=self.ep.node,
                    reason=why,
                ),
                job.key,
            )


def decode_items(msg: Save, capacity: int) -> tuple[list[ItemRecord], list[Placement]]:
    """Records and relative placements of a SAVE's items, each checked: in order, not
    overlapping, each no larger than the ring (``capacity``), and the rank's own."""
    records, placements = [], []
    end = 0
    for it in msg.items:
        if not isinstance(it, dict) or set(it) != {"record", "offset", "nbytes"}:
            raise ProtocolError("SAVE item must be {record, offset, nbytes}")
        rec = ItemRecord.from_wire(it["record"])
        off, n = it["offset"], it["nbytes"]
        if not (isinstance(off, int) and isinstance(n, int) and end <= off < _MAX_RING_OFFSET and 0 <= n <= capacity):
            raise StagingError(
                f"rank {msg.rank}: item {rec.fqn!r} at {off} ({n} bytes) overlaps the one "
                f"before it or does not fit the {capacity}-byte ring"
            )
        end = off + n
        if rec.rank != msg.rank:
            raise ProtocolError(f"rank {msg.rank} sent a record of rank {rec.rank}")
        if rec.kind == "tensor" and rec.nbytes != n:
            raise StagingError(f"rank {msg.rank}: item {rec.fqn!r} has {n} bytes, its shape needs {rec.nbytes}")
        records.append(rec)
        placements.append(Placement(off, n))
    return records, placements
