"""A rank's data file in an S3 root: one object uploaded as it is written (ckptd.storage.objwriter),
under a key that names its attempt: ``iter_<step>/__<rank>_0.<attempt>.distcp``.

No key is ever written twice, so neither a re-save of the step nor a late writer of an attempt
that died can change an object a committed checkpoint refers to; the object appears whole when
its multipart upload completes (the end of :meth:`S3DataTarget.write`), and an upload that failed
is aborted (a crash's unfinished upload is removed by the next coordinator start or ``ckptd gc``).

The daemon's items are views of a staging ring; they are uploaded from there without a copy (lent
to the sink, ckptd.storage.objwriter), so an item's ring space is freed (``written(i)``) only once
the uploader let go of every part holding its bytes, earlier items' too (the ring is freed in
order), never while a part of it may still be read. Before waiting for an item that is not
produced yet, the target copies the lent pieces of the part it is assembling: the producer may be
waiting for exactly that space, and the parts in flight free theirs without anyone's help.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError
from ..format.direct import buffer_address
from ..format.items import PlannedItem, data_file_max_nbytes, write_data_file
from ..format.records import ItemRecord
from ..format.tensorzip import RawTensor
from ..s3catalog import read_s3_commit_record, s3_abandoned_commit
from ..storage.objwriter import MAX_PARTS, PART_NBYTES, ObjectSink
from ..storage.s3client import S3Client

log = logging.getLogger(__name__)


def s3_data_file_name(attempt: str, rank: int) -> str:
    return f"__{rank}_0.{attempt}.distcp"


class S3DataTarget:
    part_nbytes = PART_NBYTES  # larger for an object of more than max_parts of them
    max_parts = MAX_PARTS

    def __init__(self, client: S3Client, step_name: str, name: str, attempt: tuple[int, str] | None = None) -> None:
        self.client = client
        self.name = name
        self.step_name = step_name
        self.attempt = attempt  # (step, attempt) of a root's save (None: ckptd.save's own object)
        self.key = f"{step_name}/{name}"
        self._sink: ObjectSink | None = None

    def write(
        self,
        items: list[PlannedItem],
        *,
        checksums: bool,
        ready: Callable[[int], None],
        written: Callable[[int], None],
        produced: Callable[[int], bool] | None = None,
    ) -> list[ItemRecord]:
        """Upload ``items``; ``written(i)`` runs (on this thread or the uploader's) once item ``i``
        and every item before it may be overwritten, and never after this returns or raises.
        Refuses (CheckpointExistsError, nothing uploaded) when the step is committed by this very
        attempt on the root's current branch: an attempt id repeats (a second Checkpointer of a
        launch with a fixed ``CKPTD_RUN_ID``), so the key is a committed object's, which the upload
        would replace. (A commit a rollback abandoned is replaced by the new save's commit, which
        retires it first.) Asked here, on the writer's thread: save() asks the store nothing."""
        if self.attempt is not None:
            step, attempt = self.attempt
            record = read_s3_commit_record(self.client, self.step_name)
            if (
                record is not None
                and record.attempt == attempt
                and not s3_abandoned_commit(self.client, step, record.seq)
            ):
                raise CheckpointExistsError(
                    f"{self.client.url(self.step_name)} is committed already, by attempt {attempt}, which this "
                    "save repeats (a fixed CKPTD_RUN_ID?); nothing was uploaded: save under a new step"
                )
        freeing = _InOrder(written)
        sink = self._sink = ObjectSink(
            self.client,
            self.key,
            self.part_nbytes,
            lendable=_Payloads(items).cover,
            on_release=lambda: freeing.advance(sink.released),
            object_nbytes=data_file_max_nbytes(items),
            max_parts=self.max_parts,
        )

        def before(i: int) -> None:
            if produced is not None and not produced(i):
                sink.let_go()  # the producer may wait for the ring space it lent
            ready(i)

        def handed(i: int) -> None:
            freeing.handed(i, sink.lent)
            freeing.advance(sink.released)

        def opener(_path: str, _mode: str) -> Any:
            return sink  # its context completes the upload, or aborts it on an error

        try:
            # fsync=False: an object is durable once its upload completed (no file descriptor to sync).
            stored = write_data_file(Path("."), self.name, items, opener, False, checksums, before, handed)
        except BaseException:
            sink.abort()  # returns once the uploader let go of every lent buffer
            raise
        finally:
            freeing.stop(sink.released)
        return stored

    def publish(self) -> int:
        """The upload completed at the end of :meth:`write`: the object's size."""
        if self._sink is None or not self._sink.completed:
            raise RuntimeError(f"{self.client.url(self.key)} was published before it was written")
        return self._sink.tell()

    def discard(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return
        if not sink.completed:
            sink.abort()
            return
        try:
            self.client.delete([self.key])  # completed, but its save failed (e.g. not sealed)
        except Exception as exc:  # noqa: BLE001 - the attempt's abort or `ckptd gc` removes it
            log.warning("could not remove %s after its save failed: %s", self.client.url(self.key), exc)


class _Payloads:
    """The address ranges of the items' payloads that may be lent to the uploader: ring views
    (RawTensor data, memoryviews) and bytes; tensors (``ckptd.save``'s own) are copied."""

    def __init__(self, items: list[PlannedItem]) -> None:
        ranges = []
        for item in items:
            payload: Any = item.payload
            data = payload.data if isinstance(payload, RawTensor) else payload
            if isinstance(data, (memoryview, bytes)):
                view = memoryview(data)
                if view.nbytes and view.c_contiguous:
                    start = buffer_address(view)
                    ranges.append((start, start + view.nbytes))
        ranges.sort()
        self._starts = [a for a, _ in ranges]
        self._ends = [b for _, b in ranges]

    def cover(self, view: memoryview) -> bool:
        """Whether ``view`` lies within one payload."""
        start = buffer_address(view)
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and start + view.nbytes <= self._ends[i]


class _InOrder:
    """Frees items in order: item ``i`` once the first ``marks[i]`` lent buffers were let go (all
    those lent up to its end). Called from the writer thread and the uploader's threads."""

    def __init__(self, written: Callable[[int], None]) -> None:
        self._written = written
        self._lock = threading.RLock()
        self._marks: list[int] = []
        self._freed = 0
        self._stopped = False

    def handed(self, i: int, lent: int) -> None:
        with self._lock:
            if i != len(self._marks):
                raise RuntimeError(f"item {i} was handed to the upload out of order")
            self._marks.append(lent)

    def advance(self, released: int) -> None:
        with self._lock:
            while not self._stopped and self._freed < len(self._marks) and self._marks[self._freed] <= released:
                self._freed += 1
                self._written(self._freed - 1)

    def stop(self, released: int) -> None:
        """Free what may be freed, then nothing more (the caller frees the rest itself)."""
        with self._lock:
            self.advance(released)
            self._stopped = True
