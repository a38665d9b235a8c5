"""The node daemon's save path: a rank's SAVE in, its data file written, the outcome reported.

Order of one save, all on the daemon's loop except step 3:

1. :meth:`SaveIntake.take` checks a SAVE against the rank's ring (its control block, ring range,
   records and producer) and binds it to the attempt's directory ``<step>.<attempt>.tmp/``; the
   rank is then acknowledged and owns nothing any more, and the write is queued behind the
   ring's earlier ones (after the answer: a writer thread started first would slow it);
2. once the ring's previous write finished, the write goes to a writer thread; if its attempt
   was aborted meanwhile (another rank skipped or failed the step), nothing is written: the
   writer only frees the save's ring space as the producer goes (:meth:`SaveIntake._drain`);
3. the writer thread writes the rank's data file into the root (ckptd.roots: a file of the
   attempt's directory, or an object) from the ring as the producer fills it
   (ckptd.daemon.workers.write_rank_file) and makes it durable;
4. :meth:`SaveIntake.on_done`: the block is free (``WRITE_DONE`` to the rank), and ``WRITTEN``
   (or ``FAILED``) goes to the coordinator. A write that finished after its attempt was decided
   is reported as FAILED, never WRITTEN.

What happens to a save after step 1 (drain or write, what is reported, the write timeout) is
decided by :class:`~ckptd.daemon.intakestate.IntakeState`, a pure state machine; this module checks
SAVEs against the rings and executes its actions.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..config import CkptdConfig
from ..control.codec import Codec
from ..control.endpoints import Endpoints
from ..control.itemchecks import check_save_items
from ..control.protocol import (
    MAX_INSTANCE_NBYTES,
    MAX_RING_OFFSET,
    AttemptInFlight,
    Failed,
    Message,
    RegisterLayout,
    Save,
    SaveItem,
    WriteDone,
    Written,
)
from ..errors import AttemptInUseError, CkptdError, ProtocolError, StagingError
from ..format.records import ItemRecord
from ..format.rootlayout import tmp_dir_name
from ..roots.base import RootStore
from ..staging.ring import ALIGN, BLOCKS, Placement, block_offset
from .guard import InternalErrors
from .intakestate import (
    Action,
    Ended,
    IntakeState,
    NotWritten,
    Ready,
    Report,
    StartWrite,
    Taken,
    TellRank,
    Tick,
    WriteJob,
    WriteResult,
)
from .metrics import DaemonMetrics
from .rings import DaemonRing, RingTable
from .snapshot import SnapshotWait, check_snapshot_child
from .uplink import CoordinatorLink
from .workers import WorkerPools, WriteFinished, WriteRequest, write_rank_file

log = logging.getLogger(__name__)


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
        *,
        internal: InternalErrors,
    ) -> None:
        self.config = config
        self.internal = internal  # the daemon's count of internal errors (ckptd.daemon.guard)
        self.rings = rings
        self.workers = workers
        self.metrics = metrics
        self.uplink = uplink
        self.store = store
        self.send_to_rank = send_to_rank
        self.state = IntakeState(config, uplink.state, node=ep.node, data_file=self._data_file)
        # Node-local disks of nodes other than node 0 (whose commit reads its own disk): the disk's
        # highest commit number, read once per attempt (every rank of the node writes one file).
        self._reports_disk_seq = config.node_local and ep.node != 0
        self._disk_seqs: dict[tuple[int, str], int] = {}
        self._disk_seq_lock = threading.Lock()

    def _data_file(self, step: int, attempt: str, rank: int) -> str:
        return self.store.display(tmp_dir_name(step, attempt), self.store.data_file_name(attempt, rank))

    def take(self, identity: bytes, rank_pid: int, msg: Save) -> Callable[[], None]:
        """Check a SAVE of the rank connected as ``identity`` (process ``rank_pid``) and take it;
        raises (StagingError, ProtocolError) when the request cannot be served. Returns what
        queues its write, to be called once the rank was answered, whatever happens meanwhile."""
        ring = self.rings.get(msg.rank, msg.generation, identity)
        ring.check_block(msg.block)
        if self.state.in_use(msg.rank, (msg.step, msg.attempt)):
            # Both would write one data file and be answered by one verdict: the first save's
            # files could be replaced under its commit, and the second told committed.
            raise AttemptInUseError(
                f"rank {msg.rank}: attempt {msg.attempt} of step {msg.step} is already being written by "
                "another save, or awaits its verdict (two Checkpointers of one launch whose attempt ids "
                "repeat: a fixed CKPTD_RUN_ID or launcher id). Wait for the first save, or close its "
                "Checkpointer, before saving the step again"
            )
        if not 0 <= msg.ring_start < MAX_RING_OFFSET or msg.ring_start % ALIGN:
            raise StagingError(f"rank {msg.rank}: ring start {msg.ring_start} is not an aligned offset")
        if not 0 <= msg.block < BLOCKS or msg.seal_offset != block_offset(msg.block):
            # Its progress and seal are read there: another save's block would be followed instead.
            raise StagingError(
                f"rank {msg.rank}: the SAVE of step {msg.step} names control block {msg.block} but its seal "
                f"at header offset {msg.seal_offset}"
            )
        records, placements, held = self._items(msg, ring)
        check_snapshot_child(msg.rank, msg.snapshot_pid, rank_pid, ring.registered_s)
        producer = SnapshotWait.open(
            msg.rank, msg.snapshot_pid, msg.seal, msg.seal_offset, child=msg.snapshot_pid != rank_pid
        )
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
            report_id=int.from_bytes(msg.seal[:8], "little"),
            went_back=(msg.went_back_to, msg.went_back_unix_s),
        )
        self._handle(Taken(job=job))

        def start_write() -> None:
            ring.queue_write(lambda: self._ready(job, ring, producer))

        try:
            self.metrics.save_received(msg.step)
            self.uplink.expect(job.key, identity)
        except Exception:  # taken: an error answer would have the rank give its ring range back
            log.exception("step %d attempt %s rank %d: taken, but not counted", msg.step, msg.attempt, msg.rank)
        log.info(
            "step %d attempt %s rank %d: %d items taken from ring offset %d",
            msg.step,
            msg.attempt,
            msg.rank,
            len(records),
            msg.ring_start,
        )
        return start_write

    def _handle(self, event: Taken | Ended) -> None:
        self._execute_each(self.state.handle(event, time.monotonic()))

    def _execute_each(self, actions: list[Action]) -> None:
        """Execute ``actions`` in order, each on its own: one that fails (a bug, an exhausted
        resource) is logged and counted as an internal error (ckptd.daemon.guard) and the others
        still run (a rank's WRITE_DONE that could not be sent must not lose its report)."""
        for action in actions:
            self.internal.run(f"save intake's {type(action).__name__}", functools.partial(self._execute, action))

    def _ready(self, job: WriteJob, ring: DaemonRing, producer: SnapshotWait) -> None:
        """The ring's earlier writes are done: write ``job`` (or drain it, if its attempt was
        aborted meanwhile) on a writer thread."""
        for action in self.state.handle(Ready(job=job), time.monotonic()):
            if isinstance(action, StartWrite):
                run = self._drain(job, ring, producer) if action.drain else self._writer(job, ring, producer)
                self.workers.write(job, run)
            else:
                self._execute_each([action])

    def _execute(self, action: Action) -> None:
        if isinstance(action, StartWrite):  # only Ready starts a write (_ready)
            raise RuntimeError(f"{action.job!r}: a write may only start when its ring is ready")
        if isinstance(action, TellRank):
            job, r = action.job, action.result
            done = WriteDone(
                generation=job.generation,
                block=job.block,
                step=job.request.step,
                attempt=job.attempt,
                write_s=r.write_s,
                queue_s=r.queue_s,
                snapshot_s=r.snapshot_s,
            )
            self.send_to_rank(done, job.identity)
        elif isinstance(action, Report):
            msg = sendable(action.msg, self.uplink.channel.codec) if isinstance(action.msg, Written) else action.msg
            self.uplink.report(msg, action.key)

    def _drain(self, job: WriteJob, ring: DaemonRing, producer: SnapshotWait) -> Callable[[], WriteResult]:
        """The writer thread's work for a save whose attempt aborted before its write started:
        write nothing (behind a slow disk, a doomed write would hold the ring and make the
        rank's next saves wait or skip), only free the ring space as the producer goes."""
        timeout_s = self.config.snapshot_timeout_s

        def run() -> WriteResult:
            try:
                producer.drain(
                    ring.map, job.request.ring_end, timeout_s, job.request.item_starts, job.request.item_ends
                )
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
                disk_seq=self._disk_seq(job.key) if self._reports_disk_seq else 0,
            )

        return run

    def _disk_seq(self, key: tuple[int, str]) -> int:
        """This node's disk's highest commit number, which node 0 numbers the commit of attempt
        ``key`` above (Written.disk_seq), read by the attempt's first write to end (the others
        reuse it); 0, with a warning, when the disk cannot be read now (the commit is then
        numbered by node 0's disk alone, as before nodes reported it)."""
        with self._disk_seq_lock:  # the node's writer threads end at once
            if key not in self._disk_seqs:
                try:
                    seq = self.store.highest_commit_seq()
                except (OSError, CkptdError) as exc:
                    log.warning("could not read the highest commit number of this node's disk: %s", exc)
                    seq = 0
                if len(self._disk_seqs) >= 64:  # attempts long committed
                    self._disk_seqs.clear()
                self._disk_seqs[key] = seq
            return self._disk_seqs[key]

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
        records, placements = decode_items(msg.rank, msg.items, ring.capacity)
        if msg.layout:
            ring.layout = (msg.layout, records, placements, msg.held)
        return records, placements, msg.held

    def register_layout(self, identity: bytes, msg: RegisterLayout) -> None:
        """Keep a REGISTER_LAYOUT's item list as the ring's layout, checked as a SAVE's items are,
        for the rank's next SAVE to name (raises StagingError, ProtocolError)."""
        if not msg.layout:
            raise ProtocolError(f"rank {msg.rank}: REGISTER_LAYOUT without a layout id")
        ring = self.rings.get(msg.rank, msg.generation, identity)
        records, placements = decode_items(msg.rank, msg.items, ring.capacity)
        ring.layout = (msg.layout, records, placements, msg.held)

    def on_done(self, done: WriteFinished) -> None:
        """A write finished: free its block, tell the rank, report to the coordinator."""
        job: WriteJob = done.job
        req = job.request
        if isinstance(done.error, NotWritten):
            log.info("%s", done.error)
        else:
            result: WriteResult = done.result if done.error is None else WriteResult()
            self.metrics.write_finished(req.step, job.nbytes, result.write_s, result.queue_s, ok=done.error is None)
        # Reported first: freeing the block starts the ring's next write, which fails once the
        # daemon stops (its writers shut down), and a durable file's WRITTEN was lost with it.
        try:
            self._handle(Ended(job=job, result=done.result, error=done.error, reason=done.reason))
        finally:  # the ring's next saves are not held up by a report that failed
            self.rings.write_done(req.rank, job.generation, job.block)

    def in_flight(self, alive: Callable[[bytes], bool]) -> list[AttemptInFlight]:
        """The attempts this node holds undecided (ckptd.daemon.intakestate.IntakeState.in_flight)."""
        return self.state.in_flight(alive)

    def tick(self, now: float) -> None:
        """Report as FAILED each write not finished ``commit_timeout_s`` after its SAVE was taken
        (ckptd.daemon.intakestate, rule 4), once."""
        self._execute_each(self.state.handle(Tick(), now))


def sendable(msg: Written, codec: Codec) -> Written | Failed:
    """``msg``, or a FAILED saying why when it exceeds ``codec``'s message limit (the records of a
    layout with very many items, or rank 0's common state): kept as the node's report, every
    send of it failed, the save's ring stayed held, and the other attempts' resends stopped.
    Judged as sent: addressed to a coordinator instance (ckptd.daemon.uplinkstate), of the longest
    a PONG can name (one that fitted only without it failed every send)."""
    texts = (msg.common_digest, msg.plain_digest, codec.job, msg.attempt, *msg.held)
    bound = 1024 + MAX_INSTANCE_NBYTES + len(msg.common or b"") + sum(4 * len(t) + 5 for t in texts)
    if bound + sum(map(_record_nbytes_bound, msg.records)) < codec.max_nbytes:
        return msg
    try:
        codec.encode(replace(msg, coordinator_instance="i" * MAX_INSTANCE_NBYTES))  # as the link sends it
    except ProtocolError as exc:
        return Failed(
            step=msg.step,
            attempt=msg.attempt,
            rank=msg.rank,
            world_size=msg.world_size,
            node=msg.node,
            reason=f"rank {msg.rank}'s report of its {len(msg.records)} items cannot be sent: {exc}",
        )
    return msg


def _record_nbytes_bound(r: ItemRecord) -> int:
    """At least the bytes of ``r`` encoded (msgpack): its field names, every string as UTF-8 (at
    most 4 bytes a character), every int in 9 bytes, each with its header."""
    texts = (r.fqn, r.kind, r.dtype, r.relative_path, *(p for p in r.path if isinstance(p, str)))
    ints = 4 + len(r.global_shape) + len(r.offsets) + len(r.sizes) + sum(not isinstance(p, str) for p in r.path)
    return 200 + sum(4 * len(t) + 5 for t in texts) + 9 * ints + len(r.block_crcs) + 5 * 6


def decode_items(rank: int, items: list[SaveItem], capacity: int) -> tuple[list[ItemRecord], list[Placement]]:
    """Records and relative placements of ``rank``'s items (a SAVE's or a REGISTER_LAYOUT's), once
    checked (the rank's own, in order, each fitting the ring of ``capacity`` bytes:
    ckptd.control.itemchecks.check_save_items)."""
    check_save_items(rank, items, capacity)
    return [it.record for it in items], [Placement(it.offset, it.nbytes) for it in items]
