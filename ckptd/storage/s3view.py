"""A checkpoint on object storage, read through the readers of local checkpoints.

:class:`S3CheckpointView` makes a private temporary directory that looks like the checkpoint:
``metadata.json``, ``.metadata`` and ``common.pt`` downloaded (each bounded by its size limit and,
in a root, checked against the CRC-32C its commit record holds), and one *sparse* file per data
object, of the object's size, whose bytes are fetched only when a reader needs them: the view's
:class:`S3RangeSource` is handed to the readers (ckptd.format.reader.DataFiles, the load executor),
which call :meth:`S3RangeSource.ensure` before they read a range and :meth:`S3RangeSource.prefetch`
with the ranges a load will read, in order. Ranges are fetched in pieces of ``PIECE_NBYTES`` on a
fixed grid of each object, by parallel ranged GETs, a bounded window ahead of the reader. A range
is never read before it was fetched (the reader waits), so a sparse file's zeros are never taken
for data. Everything the readers check (coverage, sizes, archives, CRC-32Cs) is checked as for a
local checkpoint; messages name the ``s3://`` object, not the temporary file.

The temporary directory (under ``$TMPDIR``) holds what this process read, at most the data it
loads, and is removed when the view closes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointNotFoundError, CkptdError, CorruptCheckpointError, StorageError
from ..format.checksum import crc32c
from ..format.commitrecord import COMMIT_RECORD, COMMIT_RECORD_MAX_NBYTES, CommitRecord, parse_commit_record
from ..format.layout import (
    COMMON_PT,
    COMMON_PT_MAX_NBYTES,
    DATA_SUFFIX,
    DCP_METADATA,
    DCP_METADATA_MAX_NBYTES,
    METADATA_JSON,
    METADATA_JSON_MAX_NBYTES,
)
from ..format.lease import removed_error
from .s3client import S3Client, plain_etag
from .url import S3Location

log = logging.getLogger(__name__)

PIECE_NBYTES = 16 << 20
WINDOW_NBYTES = 256 << 20  # fetched ahead of the reader at most
FETCH_THREADS = 4
SMALL_FILES = (  # the small files of a checkpoint, with their size bounds
    (METADATA_JSON, METADATA_JSON_MAX_NBYTES),
    (DCP_METADATA, DCP_METADATA_MAX_NBYTES),
    (COMMON_PT, COMMON_PT_MAX_NBYTES),
)


@dataclass(frozen=True)
class SparseObject:
    key: str
    size: int
    path: Path


class S3RangeSource:
    """Fetches byte ranges of the view's data objects into its sparse files (see the module
    docstring). Thread-safe: loads may read from several threads."""

    def __init__(self, client: S3Client, objects: dict[str, SparseObject]) -> None:
        self.client = client
        self.objects = objects
        self._pieces: dict[tuple[str, int], Future[None]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="ckptd-s3-fetch")
        self._ahead: list[tuple[str, int]] = []  # pieces the reader will want, in order
        self._next = 0
        # Fetches submitted and maybe not done yet: what counts against the window (pruned as
        # they end; counting over every piece fetched was quadratic in a checkpoint's pieces).
        self._running: list[Future[None]] = []
        # Every piece of an object is read from one version of it, the first one read: pieces of a
        # DCP checkpoint overwritten in place while it loads would be a mix of both. (Not the ETag
        # a listing gives: some S3-compatible stores list another form of it than GET returns.)
        self._etags: dict[str, str] = {}
        self.fetched_nbytes = 0

    def _grid(self, relative_path: str, offset: int, length: int) -> Iterator[tuple[str, int]]:
        obj = self.objects.get(relative_path)
        if obj is None:
            return
        first, last = offset // PIECE_NBYTES, max(offset, offset + length - 1) // PIECE_NBYTES
        for i in range(first, last + 1):
            if i * PIECE_NBYTES < obj.size:
                yield relative_path, i

    def open_file(self, relative_path: str) -> tuple[int, int] | None:
        return None  # every data object is a sparse file of the view's directory

    def prefetch(self, ranges: list[tuple[str, int, int]]) -> None:
        """The ranges a reader will read, in its order: fetched a window ahead of it."""
        seen: set[tuple[str, int]] = set()
        with self._lock:
            for rel, off, n in ranges:
                for piece in self._grid(rel, off, n):
                    if piece not in seen:
                        seen.add(piece)
                        self._ahead.append(piece)
        self._top_up()

    def ensure(self, relative_path: str, offset: int, length: int) -> None:
        """Return once bytes ``[offset, offset + length)`` of ``relative_path`` are in its file."""
        futures = [self._start(piece) for piece in self._grid(relative_path, offset, length)]
        for f in futures:
            f.result()
        self._top_up()

    def _top_up(self) -> None:
        with self._lock:
            while self._next < len(self._ahead):
                self._running = [f for f in self._running if not f.done()]
                if len(self._running) * PIECE_NBYTES >= WINDOW_NBYTES:
                    return
                piece = self._ahead[self._next]
                self._next += 1
                if piece not in self._pieces:
                    self._submit(piece)

    def _start(self, piece: tuple[str, int]) -> Future[None]:
        with self._lock:
            f = self._pieces.get(piece)
            return f if f is not None else self._submit(piece)

    def _submit(self, piece: tuple[str, int]) -> Future[None]:
        """Fetch ``piece`` on the pool (the caller holds the lock)."""
        f = self._pieces[piece] = self._pool.submit(self._fetch, *piece)
        self._running.append(f)
        return f

    def _fetch(self, relative_path: str, index: int) -> None:
        obj = self.objects[relative_path]
        start = index * PIECE_NBYTES
        length = min(PIECE_NBYTES, obj.size - start)
        data, etag = self.client.get_range(obj.key, start, length)
        if etag is not None:  # compared here: some stores ignore If-Match, or refuse their own ETag in it
            with self._lock:
                pinned = self._etags.setdefault(relative_path, etag)
            if pinned != etag:
                raise StorageError(
                    f"{self.client.url(obj.key)} was replaced while it was read (ETag {pinned}, then "
                    f"{etag}); a checkpoint must not be overwritten while it is loaded: load it again"
                )
        try:
            fd = os.open(obj.path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                view = memoryview(data)
                done = 0
                while done < length:
                    done += os.pwrite(fd, view[done:], start + done)
            finally:
                os.close(fd)
        except OSError as exc:  # a full $TMPDIR, mostly: say where the view keeps what it fetched
            raise StorageError(
                f"could not keep bytes [{start}, {start + length}) of {self.client.url(obj.key)}: "
                f"{exc.strerror or exc}; a load from S3 keeps what it reads in $TMPDIR "
                f"({tempfile.gettempdir()}) until it ends: free space there, or point TMPDIR at a "
                "larger disk"
            ) from exc
        with self._lock:
            self.fetched_nbytes += length

    def fetch_all(self) -> None:
        """Fetch every data object whole (``ckptd verify`` reads every byte)."""
        self.prefetch([(rel, 0, obj.size) for rel, obj in self.objects.items()])
        for rel, obj in self.objects.items():
            self.ensure(rel, 0, obj.size)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class S3View:
    """The local stand-in of an ``s3://`` checkpoint (see :func:`S3CheckpointView`)."""

    directory: Path
    source: S3RangeSource
    location: S3Location


@contextmanager
def s3_checkpoint_view(
    location: S3Location, client: S3Client | None = None, *, listed: bool = False
) -> Iterator[S3View]:
    """Open the checkpoint at ``location`` for reading (see the module docstring). ``listed``: the
    data objects its commit record names are checked against a LIST of its prefix (one request):
    one missing or of another size raises CorruptCheckpointError naming it. A load finds such an
    object when it reads it; the check of a resume (ckptd.recovery.structural_problem) reads no
    data, and without it took a checkpoint that lost an object for intact."""
    client = client if client is not None else S3Client(location)
    tmp = Path(tempfile.mkdtemp(prefix="ckptd-s3-"))
    source = None
    try:
        record = _commit_record_bytes(client)
        etags: dict[str, str | None] = {}
        try:
            objects = _materialize(client, location, tmp, record, etags)
            if listed and record is not None:
                _check_listed(client, objects)
            source = S3RangeSource(client, objects)
            yield S3View(tmp, source, location)
        except (CorruptCheckpointError, CheckpointNotFoundError, StorageError) as exc:
            # Retention or gc deleted it (or a re-save replaced it) while it was read: no lease
            # holds an object store, and a missing or changed object is no damage then.
            if _gone(client, record, etags):
                raise removed_error(location) from exc
            _rename_paths(exc, tmp, location)
            raise
        except CkptdError as exc:
            _rename_paths(exc, tmp, location)
            raise
    finally:
        if source is not None:
            source.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _commit_record_bytes(client: S3Client) -> bytes | None:
    got = client.get(COMMIT_RECORD, COMMIT_RECORD_MAX_NBYTES, "commit record")
    return None if got is None else got[0]


def _gone(client: S3Client, record: bytes | None, etags: dict[str, str | None]) -> bool:
    """Whether the checkpoint opened with commit record ``record`` went away: its record changed
    or vanished (a Checkpointer's commit), or (one without a record: ``ckptd.save``, DCP) its
    ``.metadata``, read with ETag ``etags[".metadata"]``, vanished or changed; False when it never
    was there (nothing read yet) or the store cannot tell now."""
    try:
        if record is not None:
            return _commit_record_bytes(client) != record
        if DCP_METADATA not in etags:
            return False
        info = client.head(DCP_METADATA)
        read = etags[DCP_METADATA]
        # Normalized: a store may quote a HEAD's ETag otherwise than a GET's.
        return info is None or (read is not None and plain_etag(info.etag or "") != plain_etag(read))
    except CkptdError:
        return False


def _materialize(
    client: S3Client, location: S3Location, tmp: Path, record: bytes | None, etags: dict[str, str | None]
) -> dict[str, SparseObject]:
    """Download the small files (their ETags into ``etags``), make the sparse data files; the data
    objects by name (``record``: the checkpoint's commit record, as read)."""
    parsed = None if record is None else parse_commit_record(record, client.url(COMMIT_RECORD))
    committed = download_small_files(client, location, tmp, parsed, etags)
    if committed is not None:
        sizes = {name: info["nbytes"] for name, info in committed.items() if name.endswith(DATA_SUFFIX)}
    else:
        _, infos = client.list_dir("")
        sizes = {i.key.rsplit("/", 1)[-1]: i.size for i in infos if i.key.endswith(DATA_SUFFIX)}
    return {name: sparse_object(location, tmp, name, name, size) for name, size in sizes.items()}


def _check_listed(client: S3Client, objects: dict[str, SparseObject]) -> None:
    """Raise CorruptCheckpointError naming the first of ``objects`` (the sizes the commit recorded)
    that a listing of the checkpoint's prefix lacks or holds with another size."""
    _, infos = client.list_dir("")
    listed = {i.key.rsplit("/", 1)[-1]: i.size for i in infos}
    wrong = [(obj, listed.get(obj.key)) for _, obj in sorted(objects.items()) if listed.get(obj.key) != obj.size]
    if not wrong:
        return
    obj, size = wrong[0]
    # Worded as a load's finding of a missing one (S3Client.get_range): the resume's warning quotes it.
    what = "is missing; the checkpoint is incomplete" if size is None else f"has {size} bytes, {obj.size} committed"
    more = f" (and {len(wrong) - 1} more data objects missing or of another size)" if len(wrong) > 1 else ""
    raise CorruptCheckpointError(f"data object {client.url(obj.key)} {what}{more}")


def sparse_object(location: S3Location, tmp: Path, name: str, key: str, size: int) -> SparseObject:
    """The sparse file ``tmp/name`` of ``size`` bytes that object ``key`` (relative to the
    checkpoint's prefix) is fetched into."""
    if "/" in name or name in (".", ".."):
        raise CorruptCheckpointError(f"{location}: a data object named {name!r} cannot be a checkpoint file")
    path = tmp / name
    try:
        with open(path, "wb") as f:
            f.truncate(size)
    except (OSError, OverflowError) as exc:  # EFBIG: a size no file of $TMPDIR's filesystem can have
        raise CorruptCheckpointError(
            f"{location}: data object {name!r} is recorded with {size} bytes, a size no local view of it "
            f"can have ({exc}); its record is damaged, or $TMPDIR ({tempfile.gettempdir()}) is on a "
            "filesystem too small for it: point TMPDIR at another one"
        ) from None
    return SparseObject(key, size, path)


def download_small_files(
    client: S3Client,
    location: S3Location,
    tmp: Path,
    record: CommitRecord | None = None,
    etags: dict[str, str | None] | None = None,
) -> dict[str, dict[str, int]] | None:
    """Download ``metadata.json``, ``.metadata`` and ``common.pt`` of the checkpoint at
    ``location`` into ``tmp``, each checked against its commit ``record`` (None: it has none, as
    the caller read it); returns the objects that record lists (None: no record). ``etags``, when
    given, gets each object's ETag as it is read."""
    committed = record.objects if record is not None and record.objects else None
    found_any = False
    for name, max_nbytes in SMALL_FILES:
        expected = (committed or {}).get(name)
        # The size the commit recorded bounds what is read (every rank reads these whole).
        limit = min(max_nbytes, expected["nbytes"]) if expected is not None else max_nbytes
        got = client.get(name, limit, name if expected is None else f"{name} (its commit recorded {limit} bytes)")
        if got is None:
            continue
        data = got[0]
        if etags is not None:
            etags[name] = got[1]
        if expected is not None and (len(data) != expected.get("nbytes") or crc32c(data) != expected.get("crc32c")):
            raise CorruptCheckpointError(
                f"{client.url(name)} is not the object its commit ({COMMIT_RECORD}) recorded (size or "
                "CRC-32C differ): it was replaced or damaged. Load an earlier checkpoint."
            )
        (tmp / name).write_bytes(data)
        found_any = True
    if not found_any:
        raise CheckpointNotFoundError(
            f"{location} is not a checkpoint: it has no {METADATA_JSON} or {DCP_METADATA} object. Pass the "
            "URL of one checkpoint (s3://bucket/prefix/iter_0000100), or use Checkpointer(root).load()"
        )
    return committed


def _rename_paths(exc: CkptdError, tmp: Path, location: S3Location) -> None:
    """Name the ``s3://`` objects in an error raised about the view's temporary files."""
    exc.args = tuple(a.replace(str(tmp), str(location)) if isinstance(a, str) else a for a in exc.args)
