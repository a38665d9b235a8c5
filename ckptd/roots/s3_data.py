"""A rank's data file in an S3 root: one object uploaded as it is written (ckptd.storage.objwriter),
under a key that names its attempt: ``iter_<step>/__<rank>_0.<attempt>.distcp``.

No key is ever written twice, so neither a re-save of the step nor a late writer of an attempt
that died can change an object a committed checkpoint refers to; the object appears whole when
its multipart upload completes (the end of :meth:`S3DataTarget.write`), and an upload that failed
is aborted (a crash's unfinished upload is removed by the next coordinator start or ``ckptd gc``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..format.items import PlannedItem, write_data_file
from ..format.records import ItemRecord
from ..storage.objwriter import ObjectSink
from ..storage.s3client import S3Client

log = logging.getLogger(__name__)


def s3_data_file_name(attempt: str, rank: int) -> str:
    return f"__{rank}_0.{attempt}.distcp"


class S3DataTarget:
    def __init__(self, client: S3Client, step_name: str, name: str) -> None:
        self.client = client
        self.name = name
        self.key = f"{step_name}/{name}"
        self._sink: ObjectSink | None = None

    def write(
        self,
        items: list[PlannedItem],
        *,
        checksums: bool,
        ready: Callable[[int], None],
        written: Callable[[int], None],
    ) -> list[ItemRecord]:
        sink = self._sink = ObjectSink(self.client, self.key)

        def opener(_path: str, _mode: str) -> Any:
            return sink  # its context completes the upload, or aborts it on an error

        # fsync=False: an object is durable once its upload completed (no file descriptor to sync).
        return write_data_file(Path("."), self.name, items, opener, False, checksums, ready, written)

    def publish(self) -> int:
        """The upload completed at the end of :meth:`write`: the object's size."""
        if self._sink is None or not self._sink.closed:
            raise RuntimeError(f"{self.client.url(self.key)} was published before it was written")
        return self._sink.tell()

    def discard(self) -> None:
        sink, self._sink = self._sink, None
        if sink is None:
            return
        if not sink.closed:
            sink.abort()
            return
        try:
            self.client.delete([self.key])  # completed, but its save failed (e.g. not sealed)
        except Exception as exc:  # noqa: BLE001 - the attempt's abort or `ckptd gc` removes it
            log.warning("could not remove %s after its save failed: %s", self.client.url(self.key), exc)
