"""A data object uploaded as it is written: the sink of ``ckptd.format.items.write_data_file`` on
object storage.

Writes are cut into parts of ``part_nbytes`` (the last one shorter), more for an object too large
for :data:`MAX_PARTS` of them (:func:`part_nbytes_for`, from the size the writer states up front;
a write past the last part allowed fails before it is uploaded); every full part is handed to
obstore's multipart writer, which uploads it while later writes go on, at most ``max_concurrency``
parts in flight (a write waits for room). obstore keeps a *reference* to each buffer it is given
until that buffer's part was uploaded (measured: a writer handed torch.save's own buffers uploaded
garbage), so a part is made of

- *copies*: bytes copied into a buffer of the sink's own, never written again once handed over
  (small writes: archive headers, small items; and everything when nothing may be lent);
- *lent* buffers: views of the caller's memory that ``lendable`` accepts (the daemon's staging
  ring: ckptd.roots.s3_data), handed over without a copy. The caller must not change that memory
  until the sink says it was let go: ``on_release()`` runs (on any thread) whenever lent buffers
  were let go, :attr:`released` is how many of the first lent buffers were (they count in the order
  they were lent, :attr:`lent` so far). A part being assembled is the sink's own until it is full;
  :meth:`let_go` copies its lent pieces so that the caller can have that memory back at once (the
  daemon calls it before it waits for its producer, who may be waiting for exactly that memory).

``close()`` completes the multipart upload: only then does the object exist (under its final key,
which names the save attempt: nothing else ever writes it). Leaving the context with an exception
aborts the upload; one left unfinished by a crash is removed by the next coordinator start or
``ckptd gc``. Both return only once obstore let go of every lent buffer (it may still hold some
for a moment after an abort), so that the caller may reuse or unmap that memory then.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import StorageError
from .s3client import S3Client

log = logging.getLogger(__name__)

# S3's smallest part is 5 MiB (except the last); larger parts mean fewer requests.
PART_NBYTES = 32 << 20
# S3's limits of one multipart upload: 10,000 parts of at most 5 GiB. A store answers part 10,001
# with an error that reads like any failed request, after 10,000 parts were uploaded.
MAX_PARTS = 10_000
MAX_PART_NBYTES = 5 << 30
# A part size grown for a large object is a whole number of these.
PART_UNIT_NBYTES = 1 << 20
MAX_CONCURRENCY = 8
# Writes smaller than this are copied even where they could be lent: a few bytes of archive
# headers are cheaper to copy than to track.
LEND_MIN_NBYTES = 64 << 10
# Copies of small writes go into buffers of this size (or the rest of the part, if less).
COPY_NBYTES = 1 << 20


def part_nbytes_for(
    object_nbytes: int | None, url: str, *, base_nbytes: int = PART_NBYTES, max_parts: int = MAX_PARTS
) -> int:
    """The part size of an upload of ``object_nbytes`` (None: not known) to ``url``: ``base_nbytes``,
    or the least whole number of :data:`PART_UNIT_NBYTES` that keeps it within ``max_parts`` parts.
    An object too large for ``max_parts`` parts of :data:`MAX_PART_NBYTES` is a StorageError."""
    if object_nbytes is None or object_nbytes <= base_nbytes * max_parts:
        return base_nbytes
    least = -(-object_nbytes // max_parts)
    part_nbytes = -(-least // PART_UNIT_NBYTES) * PART_UNIT_NBYTES
    if part_nbytes > MAX_PART_NBYTES:
        raise StorageError(
            f"{url}: an object of {object_nbytes} bytes is more than a multipart upload holds ({max_parts} parts "
            f"of at most {MAX_PART_NBYTES} bytes); nothing was uploaded: save less per rank (more ranks, or "
            "fewer or smaller tensors) or to a local root"
        )
    return part_nbytes


class ObjectSink:
    def __init__(
        self,
        client: S3Client,
        key: str,
        part_nbytes: int = PART_NBYTES,
        max_concurrency: int = MAX_CONCURRENCY,
        lendable: Callable[[memoryview], bool] | None = None,
        on_release: Callable[[], None] | None = None,
        *,
        object_nbytes: int | None = None,
        max_parts: int = MAX_PARTS,
    ) -> None:
        """Parts of ``part_nbytes``, or larger ones where ``object_nbytes`` (the object's size or a
        bound of it; None: not known) needs more than ``max_parts`` of them (:func:`part_nbytes_for`);
        a write past ``max_parts`` parts raises StorageError."""
        self.client = client
        self.key = key
        self._pos = 0
        self._object_nbytes = object_nbytes
        self._max_parts = max_parts
        self.part_nbytes = part_nbytes_for(object_nbytes, client.url(key), base_nbytes=part_nbytes, max_parts=max_parts)
        self._parts = 0  # handed to the uploader
        self._lendable = lendable
        self._on_release = on_release
        # The part being assembled: (piece, lent) in order, then the copy buffer's unsealed bytes.
        self._pieces: list[tuple[memoryview, bool]] = []
        self._filled = 0
        self._copy: bytearray | None = None
        self._copy_from = 0  # bytes of _copy before it are in _pieces already
        self._copy_at = 0
        self._lock = threading.Lock()
        self.lent = 0
        self._back: set[int] = set()  # lent pieces let go out of order
        self._released = 0
        self._writer: Any = client.writer(key, self.part_nbytes, max_concurrency)
        self._writer.__enter__()
        self.closed = False
        self.completed = False  # the object exists

    @property
    def released(self) -> int:
        """How many of the first lent buffers obstore (and this sink) let go of."""
        with self._lock:
            return self._released

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        lend = self._lendable is not None and view.nbytes >= LEND_MIN_NBYTES and self._lendable(view)
        done = 0
        while done < view.nbytes:
            if self._filled == 0 and self._parts == self._max_parts:
                raise self._too_large(self._pos + done, view.nbytes - done)
            n = min(view.nbytes - done, self.part_nbytes - self._filled)
            if lend:
                self._lend(view[done : done + n])
            else:
                self._copy_in(view[done : done + n])
            self._filled += n
            done += n
            if self._filled == self.part_nbytes:
                self._hand_over()
        self._pos += view.nbytes
        return view.nbytes

    def _too_large(self, at: int, more_nbytes: int) -> StorageError:
        sized = "an object of unknown size" if self._object_nbytes is None else f"at most {self._object_nbytes} bytes"
        return StorageError(
            f"{self.client.url(self.key)}: {more_nbytes} more bytes after {at} would need part "
            f"{self._max_parts + 1} of its multipart upload, and a multipart upload has at most {self._max_parts} "
            f"parts; the upload is aborted before that part (its parts of {self.part_nbytes} bytes were sized for "
            f"{sized}: report this as a bug)"
        )

    def _copy_in(self, chunk: memoryview) -> None:
        n = chunk.nbytes
        if self._copy is None or len(self._copy) - self._copy_at < n:
            self._seal_copy()
            # A fresh buffer: obstore may hold the last one's bytes, which are never written again.
            self._copy = bytearray(max(n, min(COPY_NBYTES, self.part_nbytes - self._filled)))
            self._copy_from = self._copy_at = 0
        self._copy[self._copy_at : self._copy_at + n] = chunk
        self._copy_at += n

    def _seal_copy(self) -> None:
        """The copied bytes not yet in the part's pieces become its next piece."""
        if self._copy is not None and self._copy_at > self._copy_from:
            self._pieces.append((memoryview(self._copy)[self._copy_from : self._copy_at], False))
            self._copy_from = self._copy_at

    def _lend(self, piece: memoryview) -> None:
        """``piece`` (a fresh view, referenced only by the part and then by obstore) joins the part;
        when the last reference goes, it counts as let go."""
        self._seal_copy()
        done = weakref.finalize(piece, self._let_go_of, self.lent)
        done.atexit = False
        self.lent += 1
        self._pieces.append((piece, True))

    def _let_go_of(self, seq: int) -> None:
        """Lent piece ``seq`` is referenced no more (runs on obstore's threads, or this one)."""
        with self._lock:
            self._back.add(seq)
            while self._released in self._back:
                self._back.discard(self._released)
                self._released += 1
        if self._on_release is not None:
            try:
                self._on_release()
            except Exception:  # on obstore's thread: nobody to raise to
                log.exception("releasing the memory lent to the upload of %s failed", self.client.url(self.key))

    def let_go(self) -> None:
        """Copy the lent pieces of the part being assembled (obstore holds only whole parts):
        afterwards the sink holds none of the caller's memory that obstore was not given."""
        if not any(lent for _, lent in self._pieces):
            return
        self._seal_copy()
        buf = bytearray(self.part_nbytes)  # also the copy buffer of the rest of this part
        at = 0
        for piece, _ in self._pieces:
            buf[at : at + piece.nbytes] = piece
            at += piece.nbytes
        self._pieces = []  # the lent pieces go: their finalizers run
        self._copy, self._copy_from, self._copy_at = buf, 0, at

    def _hand_over(self) -> None:
        """Give the part's pieces to the uploader, which keeps them until the part is uploaded."""
        self._seal_copy()
        pieces, self._pieces = self._pieces, []
        self._copy, self._filled = None, 0
        self._parts += 1
        failure: Exception | None = None
        try:
            for i in range(len(pieces)):
                piece, pieces[i] = pieces[i][0], (memoryview(b""), False)
                try:
                    self._writer.write(piece)
                finally:
                    del piece  # only obstore may hold it now
        except Exception as exc:  # noqa: BLE001 - obstore's errors
            failure = exc
        finally:
            pieces.clear()
        if failure is not None:
            raise self.client._error(failure, self.key, "upload") from None

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Parts go out as they fill; the object is complete only at :meth:`close`."""

    def close(self) -> None:
        """Complete the upload (the object appears, whole, under its key); returns once every
        lent buffer was let go."""
        if self.closed:
            return
        if self._filled:
            self._hand_over()
        self.closed = True
        failure: Exception | None = None
        try:
            self._writer.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            failure = exc
        if failure is not None:
            self._wait_released()
            raise self.client._error(failure, self.key, "complete the upload of") from None
        self.completed = True
        if not self._wait_released():
            raise StorageError(
                f"{self.client.url(self.key)}: the upload completed, but its client still holds "
                f"{self.lent - self.released} of the buffers it was lent after "
                f"{self.client.settings.request_timeout_s:g} s; the save fails (report this as a bug)"
            )

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pieces, self._copy = [], None
        try:
            self._writer.__exit__(StorageError, StorageError("aborted"), None)
        except Exception:  # noqa: BLE001 - the upload is left for gc; nothing to add to the error already raised
            pass
        if not self._wait_released():
            log.error(
                "%s: the aborted upload's client still holds %d of the buffers it was lent",
                self.client.url(self.key),
                self.lent - self.released,
            )

    def _wait_released(self) -> bool:
        """Wait until every lent buffer was let go (obstore drops an aborted part's buffers a moment
        after the abort returns), at most one request's timeout; whether they were."""
        deadline = time.monotonic() + self.client.settings.request_timeout_s
        pause = 0.0005
        while self.released < self.lent:
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return True

    def __enter__(self) -> ObjectSink:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
