"""Background work of a daemon: data-file writers and the commit thread, reporting to the loop.

The daemon's control loop is single-threaded around a zmq poller. File I/O runs on thread pools;
each finished job posts its :data:`Completion` (one type per kind of job: :class:`WriteFinished`,
:class:`CommitFinished`, :class:`CleanupFinished`, :class:`RootAnswered`, :class:`RootChecked`,
:class:`NodeCommitFinished`) into
:class:`Completions`, whose pipe wakes the poller, and the loop routes it by its type. Worker threads
never touch sockets or daemon state.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..format.items import PlannedItem
from ..format.records import TENSOR, ItemRecord
from ..format.tensorzip import RawTensor
from ..roots.base import DataTarget
from ..staging.ring import RingMap, span
from .snapshot import SnapshotWait, free_up_to

if TYPE_CHECKING:
    from ..staging.ring import Placement

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Finished:
    """What every completion carries: the job's result, or the exception it raised (None on
    success; kept as the exception, so that a handler can tell its kinds apart)."""

    result: Any = None
    error: Exception | None = None

    @property
    def reason(self) -> str:
        """The error as one line for reports and logs ("" on success)."""
        return "" if self.error is None else f"{type(self.error).__name__}: {self.error}"


@dataclass(frozen=True, kw_only=True)
class WriteFinished(Finished):
    """A data-file write (the intake's ``WriteJob``) finished."""

    job: Any


@dataclass(frozen=True, kw_only=True)
class CommitFinished(Finished):
    """The commit of ``attempt`` of ``step`` finished (result: the store's CommitOutcome)."""

    step: int
    attempt: str


@dataclass(frozen=True, kw_only=True)
class CleanupFinished(Finished):
    """The removal of a decided attempt's leftovers finished."""

    step: int
    attempt: str


@dataclass(frozen=True, kw_only=True)
class RootAnswered(Finished):
    """The root answered a coordinator's ``question`` (ckptd.daemon.rootquestions; result: RootFacts)."""

    question: Any


@dataclass(frozen=True, kw_only=True)
class RootChecked(Finished):
    """The root was asked whether ``attempt`` of ``step`` committed (result: a bool); a node
    daemon asks when its coordinator was lost (ckptd.daemon.uplinkstate)."""

    step: int
    attempt: str


@dataclass(frozen=True, kw_only=True)
class NodeCommitFinished(Finished):
    """This node's part of a node-local commit finished (ckptd.daemon.nodelocal); ``verdict``: the
    coordinator's STEP_COMMITTED, held back from the ranks meanwhile."""

    verdict: Any


Completion = WriteFinished | CommitFinished | CleanupFinished | RootAnswered | RootChecked | NodeCommitFinished


class Completions:
    """A thread-safe queue whose read end (:attr:`fd`) a zmq poller can watch."""

    def __init__(self) -> None:
        self._q: queue.Queue[Completion] = queue.Queue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        # A full pipe holds wake-ups enough: a write never blocks a worker, nor the main thread
        # inside a signal handler (which would then wait for itself to drain the pipe).
        os.set_blocking(self._w, False)
        self._signalled = False
        self._closed = False  # a signal after close() must not write into a reused descriptor number

    @property
    def fd(self) -> int:
        return self._r

    def post_signal(self) -> None:
        """Async-signal-safe wake-up (no locks): for signal handlers."""
        self._signalled = True
        if self._closed:
            return
        try:
            os.write(self._w, b"s")
        except BlockingIOError:
            pass

    def signalled(self) -> bool:
        return self._signalled

    def post(self, done: Completion) -> None:
        self._q.put(done)
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def drain(self) -> list[Completion]:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # first: a signal handler runs on this thread, between two statements
        os.close(self._r)
        os.close(self._w)


@dataclass(frozen=True, kw_only=True)
class WriteRequest:
    """One rank's save as the daemon received it: records, where each payload sits relative to
    the save's virtual start ``ring_start`` in the rank's ring, and rank 0's common state."""

    step: int
    rank: int
    records: list[ItemRecord]
    placements: list[Placement]
    common: bytes | None
    ring_start: int

    @property
    def item_starts(self) -> list[int]:
        """Where each item starts in the ring (virtual offsets, in order)."""
        return [self.ring_start + p.offset for p in self.placements]

    @property
    def item_ends(self) -> list[int]:
        """Where each item ends in the ring (virtual offsets, in order)."""
        return [self.ring_start + p.offset + p.nbytes for p in self.placements]

    @property
    def ring_end(self) -> int:
        """The save's virtual end: where the next save of the rank starts."""
        return self.ring_start + span(p.offset + p.nbytes for p in self.placements)


def planned_items(ring: RingMap, req: WriteRequest) -> list[PlannedItem]:
    """Items whose payloads are views of the shared-memory ring (zero-copy): tensors as
    :class:`~ckptd.format.tensorzip.RawTensor` (written without torch.save)."""
    out = []
    for rec, p in zip(req.records, req.placements):
        raw = ring.view(req.ring_start + p.offset, p.nbytes)
        payload = RawTensor(rec.dtype, tuple(rec.sizes), raw) if rec.kind == TENSOR else raw
        out.append(PlannedItem(rec, payload))  # type: ignore[arg-type]
    return out


def write_rank_file(
    target: DataTarget,
    ring: RingMap,
    req: WriteRequest,
    checksums: bool,
    snapshot: SnapshotWait,
    snapshot_timeout_s: float,
) -> tuple[list[ItemRecord], int]:
    """Write the data file of ``req`` into ``target`` (ckptd.roots.base.DataTarget: a file of a
    POSIX root or an object of an S3 root) from the ring; returns the stored records and the
    file's size (the coordinator checks it before it commits).

    The ``snapshot``'s producer (the rank's fork child, or the rank itself) may still be copying:
    each item is written once it was produced, its ring space is freed once it was handed to the
    target (so the producer can go on with a save bigger than the ring), and the file is published
    only after the producer sealed the save; a producer that died early fails the write. The save's
    whole ring space is free again when this returns or raises (after a failure, once the
    producer stopped writing: :meth:`SnapshotWait.drain`).
    """
    t0 = time.perf_counter()
    items = planned_items(ring, req)
    starts, ends = req.item_starts, req.item_ends

    def ready(i: int) -> None:
        snapshot.wait_for(ring, ends[i], snapshot_timeout_s)

    def produced(i: int) -> bool:
        return snapshot.progress(ring) >= ends[i]

    # Each item's space is freed with the padding before the next one, which holds nothing: an item
    # a few bytes short of the ring's capacity needs that room before any of it is produced (its
    # producer would wait for it, this writer for the item). Likewise the padding before this
    # save's first item (the rank's earlier saves were written or drained: a ring's writes run in
    # order).
    def written(i: int) -> None:
        ring.set_consumed(free_up_to(ends[i], starts, ends))

    ring.set_consumed(free_up_to(ring.consumed(), starts, ends))
    try:
        try:
            stored = target.write(items, checksums=checksums, ready=ready, written=written, produced=produced)
            snapshot.wait(ring, snapshot_timeout_s)  # sealed: every byte written was final
        except BaseException:
            del items
            snapshot.drain(ring, req.ring_end, snapshot_timeout_s, starts, ends)
            raise
        ring.set_consumed(req.ring_end)
        file_nbytes = target.publish()
    except BaseException:
        target.discard()
        raise
    finally:
        snapshot.close()
    nbytes = sum(p.nbytes for p in req.placements)
    dt = time.perf_counter() - t0
    log.info(
        "step %d rank %d: wrote %d bytes in %.3f s (%.2f GB/s)",
        req.step,
        req.rank,
        nbytes,
        dt,
        nbytes / max(dt, 1e-9) / 1e9,
    )
    return stored, file_nbytes


class WorkerPools:
    """``writer_threads`` data-file writers, one commit thread and one thread that asks the root,
    reporting into ``completions``."""

    def __init__(self, writer_threads: int, completions: Completions) -> None:
        self.completions = completions
        self._writers = ThreadPoolExecutor(writer_threads, thread_name_prefix="ckptd-writer")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-commit")
        self._asker = ThreadPoolExecutor(1, thread_name_prefix="ckptd-ask")
        self.in_flight = 0

    def _run(self, done: Callable[..., Completion], what: str, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except BaseException as exc:  # reported to the loop, which aborts the step
            log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)
            # Posted whatever it was: without it the step waits forever and the daemon never idles.
            self.completions.post(done(error=exc))
            if not isinstance(exc, Exception):
                raise
        else:
            self.completions.post(done(result=result))

    def write(self, job: Any, fn: Callable[[], Any]) -> None:
        """Run the write of ``job`` on a writer thread; a :class:`WriteFinished` tells its end."""
        self.in_flight += 1
        self._writers.submit(self._run, functools.partial(WriteFinished, job=job), f"write {job!r}", fn)

    def commit(self, step: int, attempt: str, fn: Callable[[], Any]) -> None:
        """Run a commit on the commit thread; a :class:`CommitFinished` tells its end."""
        self.in_flight += 1
        done = functools.partial(CommitFinished, step=step, attempt=attempt)
        self._committer.submit(self._run, done, f"commit of step {step} attempt {attempt}", fn)

    def cleanup(self, step: int, attempt: str, fn: Callable[[], Any]) -> None:
        """Run a cleanup on the commit thread (after any commit of the attempt); a
        :class:`CleanupFinished` tells its end."""
        self.in_flight += 1
        done = functools.partial(CleanupFinished, step=step, attempt=attempt)
        self._committer.submit(self._run, done, f"cleanup of step {step} attempt {attempt}", fn)

    def node_commit(self, verdict: Any, fn: Callable[[], Any]) -> None:
        """Run this node's part of a node-local commit on the commit thread; a
        :class:`NodeCommitFinished` tells its end."""
        self.in_flight += 1
        done = functools.partial(NodeCommitFinished, verdict=verdict)
        self._committer.submit(self._run, done, f"the node's commit of step {verdict.step}", fn)

    def ask(self, question: Any, fn: Callable[[], Any]) -> None:
        """Ask the root ``question`` on the asking thread (never behind a long commit); a
        :class:`RootAnswered` tells the answer."""
        self.in_flight += 1
        done = functools.partial(RootAnswered, question=question)
        self._asker.submit(self._run, done, f"asking the root {question!r}", fn)

    def check(self, step: int, attempt: str, fn: Callable[[], bool]) -> None:
        """Ask the root whether ``attempt`` of ``step`` committed, on the asking thread (on node 0
        never behind a commit); a :class:`RootChecked` tells the answer."""
        self.in_flight += 1
        done = functools.partial(RootChecked, step=step, attempt=attempt)
        self._asker.submit(self._run, done, f"the root's check of step {step} attempt {attempt}", fn)

    def finished(self) -> None:
        self.in_flight -= 1

    def shutdown(self, timeout_s: float) -> bool:
        """Stop the pools: queued jobs are cancelled, running ones waited for up to ``timeout_s``
        in all. False when one still runs then (a write or commit stuck in a hung filesystem or
        store): the process must then exit without joining it (ckptd.daemon.main)."""
        deadline = time.monotonic() + timeout_s
        pools = (self._writers, self._committer, self._asker)
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        threads = [t for pool in pools for t in getattr(pool, "_threads", ())]  # the executor's own
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)
