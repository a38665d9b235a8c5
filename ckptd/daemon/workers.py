"""Background work of a daemon: data-file writers and the commit thread, reporting to the loop.

The daemon's control loop is single-threaded around a zmq poller. File I/O runs on thread pools;
each finished job posts a :class:`Done` into :class:`Completions`, whose pipe wakes the poller,
and the loop handles it. Worker threads never touch sockets or daemon state.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import secrets
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StorageError
from ..format.durable import Opener
from ..format.items import PlannedItem, write_data_file
from ..format.layout import data_file_name
from ..format.records import TENSOR, ItemRecord
from ..format.rootlayout import part_file_name
from ..format.safefs import Dir
from ..format.tensorzip import RawTensor
from ..staging.pool import Placement
from ..staging.ring import RingMap, span
from .snapshot import SnapshotWait

log = logging.getLogger(__name__)


@dataclass
class Done:
    """A finished background job: ``kind`` names the handler, ``error`` is None on success."""

    kind: str
    key: Any
    result: Any = None
    error: str | None = None


class Completions:
    """A thread-safe queue whose read end (:attr:`fd`) a zmq poller can watch."""

    def __init__(self) -> None:
        self._q: queue.Queue[Done] = queue.Queue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)

        self._signalled = False

    @property
    def fd(self) -> int:
        return self._r

    def post_signal(self) -> None:
        """Async-signal-safe wake-up (no locks): for signal handlers."""
        self._signalled = True
        try:
            os.write(self._w, b"s")
        except BlockingIOError:
            pass

    def signalled(self) -> bool:
        return self._signalled

    def post(self, done: Done) -> None:
        self._q.put(done)
        try:
            os.write(self._w, b"x")
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def drain(self) -> list[Done]:
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
        os.close(self._r)
        os.close(self._w)


@dataclass(frozen=True)
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
    directory: Path,
    ring: RingMap,
    req: WriteRequest,
    opener: Opener,
    fsync: bool,
    checksums: bool,
    snapshot: SnapshotWait,
    snapshot_timeout_s: float,
) -> tuple[list[ItemRecord], int]:
    """Write ``__<rank>_0.distcp`` of ``req`` into ``directory`` from the ring; returns the stored
    records and the file's size (the coordinator checks it before it commits).

    The ``snapshot``'s producer (the rank's fork child, or the rank itself) may still be copying:
    each item is written once it was produced, its ring space is freed once it was written (so
    the producer can go on with a save bigger than the ring), and the file is published only
    after the producer sealed the save; a producer that died early fails the write. The save's
    whole ring space is free again when this returns or raises (after a failure, once the
    producer stopped writing: :meth:`SnapshotWait.drain`).

    The file is written under a private ``.part`` name, fsynced, then renamed into place *by path*
    (relative to the root's fd). A write that outlives its attempt therefore never rewrites a file
    of a committed checkpoint: once its attempt's directory was renamed, the final rename fails
    instead. The directory is created here, on the writer thread, so that a directory the daemon
    may not write (permissions, read-only or full filesystem) fails this save on its handle; a link
    in its place fails it with StorageError naming the link, and the ``.part`` file is created
    relative to the directory's fd, so nothing is written through a link planted in the root (see
    ckptd.format.safefs).
    """
    name = data_file_name(req.rank)
    part = part_file_name(name, secrets.token_hex(8))
    step_name = directory.name
    t0 = time.perf_counter()
    try:
        rootd = Dir.open(directory.parent, create=True)
        try:
            # Held so that the .part file can be removed wherever the directory was renamed to meanwhile.
            stepd = rootd.subdir(step_name, create=True)
        except BaseException:
            rootd.close()
            raise
    except OSError as exc:
        snapshot.drain(ring, req.ring_end, snapshot_timeout_s)
        snapshot.close()
        raise StorageError.from_oserror(exc, directory) from exc
    items = planned_items(ring, req)
    ends = [req.ring_start + p.offset + p.nbytes for p in req.placements]

    def ready(i: int) -> None:
        snapshot.wait_for(ring, ends[i], snapshot_timeout_s)

    def written(i: int) -> None:
        ring.set_consumed(ends[i])

    try:
        try:
            stored = write_data_file(stepd, part, items, opener, fsync, checksums, ready, written)
            snapshot.wait(ring, snapshot_timeout_s)  # sealed: every byte written was final
        except BaseException:
            del items
            snapshot.drain(ring, req.ring_end, snapshot_timeout_s)
            raise
        ring.set_consumed(req.ring_end)
        _publish(rootd, stepd, step_name, part, name)
        st = stepd.lstat(name)
        file_nbytes = st.st_size if st is not None else -1
        if fsync:
            stepd.fsync()  # the new name is durable before WRITTEN goes out
    except BaseException as exc:
        stepd.unlink(part)
        if isinstance(exc, OSError):
            raise StorageError.from_oserror(exc, directory / part) from exc
        raise
    finally:
        stepd.close()
        rootd.close()
        snapshot.close()
    stored = [dataclasses.replace(r, relative_path=name) for r in stored]
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


def _publish(rootd: Dir, stepd: Dir, step_name: str, part: str, name: str) -> None:
    """Rename ``part`` to ``name`` in ``<root>/<step_name>``, by path, and only while that name
    still is the directory written into (not renamed by a commit, not replaced by a link)."""
    st = rootd.lstat(step_name)
    if st is None or not stat.S_ISDIR(st.st_mode) or not os.path.samestat(st, os.fstat(stepd.fd)):
        raise OSError(
            errno.ENOENT, f"{os.strerror(errno.ENOENT)} (renamed or replaced meanwhile)", str(rootd.path / step_name)
        )
    os.rename(f"{step_name}/{part}", f"{step_name}/{name}", src_dir_fd=rootd.fd, dst_dir_fd=rootd.fd)


class WorkerPools:
    """``writer_threads`` data-file writers and one commit thread, reporting into ``completions``."""

    def __init__(self, writer_threads: int, completions: Completions) -> None:
        self.completions = completions
        self._writers = ThreadPoolExecutor(writer_threads, thread_name_prefix="ckptd-writer")
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckptd-commit")
        self.in_flight = 0

    def _run(self, kind: str, key: Any, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - reported to the loop, which aborts the step
            log.warning("%s %r failed: %s: %s", kind, key, type(exc).__name__, exc)
            self.completions.post(Done(kind, key, error=f"{type(exc).__name__}: {exc}"))
        else:
            self.completions.post(Done(kind, key, result))

    def write(self, key: Any, fn: Callable[[], Any]) -> None:
        self.in_flight += 1
        self._writers.submit(self._run, "write", key, fn)

    def commit(self, key: Any, fn: Callable[[], Any]) -> None:
        self.in_flight += 1
        self._committer.submit(self._run, "commit", key, fn)

    def finished(self) -> None:
        self.in_flight -= 1

    def shutdown(self) -> None:
        self._writers.shutdown(wait=True, cancel_futures=True)
        self._committer.shutdown(wait=True, cancel_futures=True)
