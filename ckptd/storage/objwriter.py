"""A data object uploaded as it is written: the sink of ``ckptd.format.items.write_data_file`` on
object storage.

``torch.save`` streams each item through ``write``; the bytes are copied once, into the current
part's buffer, so the caller may reuse its memory (torch.save's own buffers, staging-ring space)
as soon as ``write`` returns. obstore keeps a reference to what it is given and uploads it later
(measured: a writer handed torch.save's buffers directly uploaded garbage), so each full part is a
fresh buffer handed over and never touched again; every ``part_nbytes`` a part is uploaded while
later writes go on, at most ``max_concurrency`` parts in flight. ``close()`` completes the
multipart upload: only then does the object exist (under its final key, which names the save
attempt: nothing else ever writes it). Leaving the context with an exception aborts the upload;
one left unfinished by a crash is removed by the next coordinator start or ``ckptd gc``.
"""

from __future__ import annotations

from typing import Any

from ..errors import StorageError
from .s3client import S3Client

# S3's smallest part is 5 MiB (except the last); larger parts mean fewer requests.
PART_NBYTES = 32 << 20
MAX_CONCURRENCY = 8


class ObjectSink:
    def __init__(
        self, client: S3Client, key: str, part_nbytes: int = PART_NBYTES, max_concurrency: int = MAX_CONCURRENCY
    ) -> None:
        self.client = client
        self.key = key
        self._pos = 0
        self._part_nbytes = part_nbytes
        self._part = bytearray(part_nbytes)
        self._filled = 0
        self._writer: Any = client.writer(key, part_nbytes, max_concurrency)
        self._writer.__enter__()
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < view.nbytes:
            n = min(view.nbytes - done, self._part_nbytes - self._filled)
            self._part[self._filled : self._filled + n] = view[done : done + n]
            self._filled += n
            done += n
            if self._filled == self._part_nbytes:
                self._hand_over()
        self._pos += view.nbytes
        return view.nbytes

    def _hand_over(self) -> None:
        """Give the filled part to the uploader (which keeps it) and start a fresh one."""
        part = self._part if self._filled == self._part_nbytes else self._part[: self._filled]
        self._part, self._filled = bytearray(self._part_nbytes), 0
        try:
            self._writer.write(part)
        except Exception as exc:  # noqa: BLE001 - obstore's errors
            raise self.client._error(exc, self.key, "upload") from None

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        """Parts go out as they fill; the object is complete only at :meth:`close`."""

    def close(self) -> None:
        """Complete the upload (the object appears, whole, under its key)."""
        if self.closed:
            return
        if self._filled:
            self._hand_over()
        self.closed = True
        try:
            self._writer.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            raise self.client._error(exc, self.key, "complete the upload of") from None

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._writer.__exit__(StorageError, StorageError("aborted"), None)
        except Exception:  # noqa: BLE001 - the upload is left for gc; nothing to add to the error already raised
            pass

    def __enter__(self) -> ObjectSink:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
