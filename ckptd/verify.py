"""End-to-end verification of a checkpoint on disk (``ckptd verify``).

:func:`verify_checkpoint` checks, in this order, and keeps going after a failure so that one run
reports every problem it can see:

1. ``metadata.json`` names a supported backend (absent: a plain torch DCP checkpoint, which is
   only fine when no ckptd checksums and no ``common.pt`` say otherwise).
2. ``.metadata`` decodes (allow-list unpickler) into a chunk index; a class it names that ckptd
   does not know (UnknownClassError) is unsupported, not damage.
3. Global coverage: per tensor one dtype and shape, chunks in bounds, no overlap, no gap
   (:func:`ckptd.format.validate.validate_records`); ShardedObject keys stored once.
4. Every data file named by ``.metadata`` exists, lies inside the checkpoint and is long enough
   for every item; no two items share bytes.
5. Every item's bytes match the checksum (CRC-32C; CRC-32 for older checkpoints) recorded at save
   time (when recorded: ckptd writes them, torch DCP and Megatron-Core do not; the report says how
   many items had none).
6. ``deep``: every item is a well-formed ``torch.save`` archive whose records match the CRC-32s
   it holds (no unpickling: :mod:`ckptd.format.archive`), and decodes (``torch.load``,
   weights-only) as a tensor of the recorded shape and dtype, as a ShardedObject's one-element
   list (a ShardedObject shard, ``<key>/shard_<offsets>_<shape>``, of a torch_dist checkpoint), or
   as any value (every other byte item: the values of DCP-style state dicts, which torch DCP and
   ckptd store as ``torch.save(value)``: ints, optimizer param_groups...). A value outside the
   weights-only allow-list is a warning.
7. ``common.pt`` matches its recorded checksum and decodes weights-only.

Items are read in bounded blocks (a deep check reads one whole item at a time). Nothing is
written. Findings carry the file, item, byte offset and length involved. A file the storage fails
to open or read (a network filesystem's ESTALE or EIO, EMFILE, EACCES) is *unreadable*, not
damaged: nothing is known of its bytes (an item's read error on a local disk, EIO among them, is
damage, as for a load: :func:`ckptd.format.reader.read_error`).
"""

from __future__ import annotations

import errno
import os
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from .errors import (
    CheckpointNotFoundError,
    CkptdError,
    CorruptCheckpointError,
    StorageError,
    UnknownClassError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .format.archive import is_zip_stream, torch_save_problem
from .format.checksum import BLOCK_NBYTES, Checksum, checksum_name, crc32c, crc32c_combine, unpack_blocks
from .format.commitrecord import read_commit_record
from .format.dcp_metadata import CheckpointIndex, read_index, records_from_index, with_file_ranks
from .format.layout import (
    COMMON_PT,
    COMMON_PT_MAX_NBYTES,
    DATA_SUFFIX,
    DCP_METADATA,
    METADATA_JSON,
    read_backend_metadata,
)
from .format.reader import load_object_bytes, load_tensor_bytes, read_error, unpickle_torch
from .format.records import TENSOR, ItemRecord, dtype_from_name
from .format.safefs import entry_exists, open_regular, read_regular
from .format.validate import validate_records
from .storage.s3view import s3_checkpoint_view
from .storage.url import S3Location, parse_location
from .verifyreport import (
    ERROR,
    NOTE,
    UNKNOWN_CLASS,
    UNREADABLE,
    UNSUPPORTED,
    WARNING,
    Finding,
    ProgressSink,
    VerifyReport,
)

__all__ = ["ERROR", "NOTE", "UNREADABLE", "UNSUPPORTED", "WARNING", "Finding", "ProgressSink", "VerifyReport"]

_BLOCK_BYTES = 16 << 20
# Opening a data file fails so because of the name the checkpoint's metadata gives it (too long,
# through a file): damage of the metadata, which no retry mends. (Not EINVAL: a network
# filesystem's failing open may say that too.)
_BAD_NAME_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR})


def _item_name(r: ItemRecord) -> str:
    return f"{r.fqn} chunk {tuple(r.offsets)}" if r.kind == TENSOR else r.fqn


def _check_backend(directory: Path, report: VerifyReport) -> bool:
    """Step 1; returns whether ``metadata.json`` exists (as anything: a link or a FIFO is reported)."""
    if not entry_exists(directory, METADATA_JSON):
        return False
    try:
        read_backend_metadata(directory)
    except StorageError as exc:
        report.add(UNREADABLE, "backend", str(exc), file=METADATA_JSON)
    except CkptdError as exc:
        report.add(ERROR, "backend", str(exc), file=METADATA_JSON)
    return True


def _check_marker_absence(directory: Path, index: CheckpointIndex | None, report: VerifyReport) -> None:
    if index is not None and index.has_checksums:
        report.add(
            ERROR,
            "backend",
            f"{METADATA_JSON} is missing but .metadata holds ckptd checksums: "
            "the checkpoint was written by ckptd and its commit marker is gone",
            file=METADATA_JSON,
        )
    elif entry_exists(directory, COMMON_PT):
        report.add(
            ERROR,
            "backend",
            f"{METADATA_JSON} is missing but {COMMON_PT} exists: a "
            "ckptd/Megatron-Core checkpoint without its commit marker (interrupted save?)",
            file=METADATA_JSON,
        )
    elif index is not None:
        report.add(NOTE, "backend", f"no {METADATA_JSON}: a plain torch DCP checkpoint (no common state)")


def _check_coverage(records: list[ItemRecord], report: VerifyReport) -> None:
    by_key: dict[str, list[ItemRecord]] = defaultdict(list)
    for r in records:
        by_key[r.fqn].append(r)
    for fqn, group in sorted(by_key.items()):
        try:
            validate_records(group, objects=False)  # one key at a time: not a ShardedObject's shards together
        except CkptdError as exc:
            report.add(ERROR, "coverage", str(exc), item=fqn)


def _committed_sizes(directory: Path) -> dict[str, int]:
    """The data files and sizes a node-local commit record of ``directory`` lists (else none)."""
    commit = read_commit_record(directory)
    return {n: o["nbytes"] for n, o in (commit.objects or {}).items()} if commit is not None else {}


def _check_files(
    directory: Path, records: list[ItemRecord], report: VerifyReport, committed: Mapping[str, int]
) -> dict[str, int]:
    """Step 4; returns the size of every data file that exists and is safe to open: a regular file
    inside the checkpoint (a link, FIFO or device is reported, never followed or read).
    ``committed``: a node-local commit's data files and sizes (ckptd.roots.nodelocal), of which
    those missing here are on other nodes' disks."""
    sizes: dict[str, int] = {}
    elsewhere = 0
    by_file: dict[str, list[ItemRecord]] = defaultdict(list)
    for r in records:
        by_file[r.relative_path].append(r)
    report.data_files = len(by_file)
    for rel, items in sorted(by_file.items()):
        if not rel or os.sep in rel or (os.altsep and os.altsep in rel) or rel.startswith(".."):
            report.add(
                ERROR,
                "file",
                f".metadata names data file {rel!r} outside the checkpoint directory (for {len(items)} items)",
                file=rel,
            )
            continue
        try:
            fd, sizes[rel] = open_regular(directory, rel, "data file")
            os.close(fd)
        except FileNotFoundError:
            if rel in committed:
                elsewhere += 1
                continue
            first = min(items, key=lambda r: r.file_offset)
            report.add(
                ERROR,
                "file",
                f"data file {rel} is missing; {len(items)} items are stored in it (first: {_item_name(first)})",
                file=rel,
            )
            continue
        except CkptdError as exc:  # a link, a FIFO: reported, never followed
            report.add(ERROR, "file", f"{exc} ({len(items)} items are stored in it)", file=rel)
            continue
        except OSError as exc:
            if exc.errno in _BAD_NAME_ERRNOS:  # the name is the metadata's: damage, not the storage
                report.add(ERROR, "file", f"data file {rel!r} cannot be opened: {exc.strerror}", file=rel)
                continue
            unreadable = StorageError.reading(exc, directory / rel, "data file")
            report.add(UNREADABLE, "file", f"{unreadable} ({len(items)} items are stored in it)", file=rel)
            continue
        size = sizes[rel]
        if rel in committed and committed[rel] != size:
            report.add(
                ERROR,
                "file",
                f"data file {rel} has {size} bytes, its commit recorded {committed[rel]}",
                file=rel,
            )
        prev: ItemRecord | None = None
        for r in sorted(items, key=lambda r: (r.file_offset, r.length)):
            end = r.file_offset + r.length
            if r.file_offset < 0 or r.length < 0:
                report.add(
                    ERROR,
                    "range",
                    f"{_item_name(r)} has an invalid byte range "
                    f"(offset {r.file_offset}, length {r.length}) in .metadata",
                    file=rel,
                    item=_item_name(r),
                    offset=r.file_offset,
                    length=r.length,
                )
            elif end > size:
                report.add(
                    ERROR,
                    "range",
                    f"data file {rel} is truncated: {_item_name(r)} needs bytes "
                    f"[{r.file_offset}, {end}) but the file has {size} bytes",
                    file=rel,
                    item=_item_name(r),
                    offset=r.file_offset,
                    length=r.length,
                )
            if prev is not None and r.file_offset < prev.file_offset + prev.length:
                report.add(
                    ERROR,
                    "range",
                    f"{_item_name(prev)} and {_item_name(r)} share bytes of {rel} "
                    f"(from offset {r.file_offset}); .metadata is inconsistent",
                    file=rel,
                    item=_item_name(r),
                    offset=r.file_offset,
                    length=r.length,
                )
            prev = r
    try:
        on_disk = {n for n in os.listdir(directory) if n.endswith(DATA_SUFFIX)}
    except OSError as exc:
        report.add(UNREADABLE, "file", str(StorageError.reading(exc, directory, "checkpoint directory")))
        on_disk = set()
    for extra in sorted(on_disk - set(by_file)):
        report.add(
            WARNING,
            "file",
            f"data file {extra} is not referenced by .metadata (left over by another save?)",
            file=extra,
        )
    if elsewhere and elsewhere == len(by_file):
        # Every node holds its own ranks' files: a disk with none of the commit's lost its own.
        report.add(
            ERROR,
            "file",
            f"none of the {elsewhere} data files the commit records is on this disk; a node-local root's "
            "node holds its own ranks' files: this node's are lost (the mirror's copy holds them all)",
        )
    elif elsewhere:
        report.add(
            NOTE,
            "file",
            f"{elsewhere} of {len(by_file)} data files are on other nodes' disks (a node-local root: each "
            "node holds its own ranks' files; the mirror holds them all)",
        )
    return sizes


def _read_item(
    fd: int, r: ItemRecord, keep: bool, progress: ProgressSink | None, prefetch: Executor, checksum: Checksum
) -> tuple[int, list[int], bytes | None]:
    """Checksum of one item's bytes, its blocks' checksums (when the record has block checksums:
    the item's is then derived from them, ckptd.format.checksum) and the bytes themselves when
    ``keep``.

    The next block is read on ``prefetch`` while this thread checksums the current one (both
    release the GIL), so reading and checksumming overlap.
    """
    crc = 0
    blocks: list[int] = []
    by_block = bool(r.block_crcs) and checksum is crc32c  # block checksums are CRC-32Cs
    step = BLOCK_NBYTES if by_block else _BLOCK_BYTES
    parts: list[bytes] = []
    pos, end = r.file_offset, r.file_offset + r.length
    pending = prefetch.submit(_pread_full, fd, min(step, end - pos), pos) if pos < end else None
    while pending is not None:
        block = pending.result()
        if not block:
            raise OSError(f"unexpected end of file at offset {pos}")
        nxt = pos + len(block)
        pending = prefetch.submit(_pread_full, fd, min(step, end - nxt), nxt) if nxt < end else None
        if by_block:
            blocks.append(checksum(block, 0))
            crc = blocks[0] if len(blocks) == 1 else crc32c_combine(crc, blocks[-1], len(block))
        else:
            crc = checksum(block, crc)
        if keep:
            parts.append(block)
        pos = nxt
        if progress is not None:
            progress.advance(len(block))
    return crc, blocks, (b"".join(parts) if keep else None)


def _pread_full(fd: int, nbytes: int, offset: int) -> bytes:
    """``nbytes`` at ``offset``, or fewer only at the end of the file: a short read (a network
    filesystem, a signal) is read on, so that blocks stay where their checksums say."""
    data = os.pread(fd, nbytes, offset)
    while 0 < len(data) < nbytes:
        more = os.pread(fd, nbytes - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _decode_item(
    r: ItemRecord, data: bytes, allow_unsafe_pickle: bool, sharded_object: bool, report: VerifyReport
) -> None:
    """Step 6 for one item, decoded by the dialect that wrote it: a ShardedObject shard
    (``sharded_object``) is a one-element list, as Megatron-Core writes it; any other byte item is a
    value as torch DCP (and ckptd for DCP-style state dicts) writes it, ``torch.save(value)`` (an
    int, an optimizer's param_groups, an ``io.BytesIO``): any value is sound."""
    where = {"file": r.relative_path, "item": _item_name(r), "offset": r.file_offset, "length": r.length}
    what = f"item {_item_name(r)}"
    # The archive first: it needs no unpickling, so it is checked even where decoding is refused.
    structure_checked = is_zip_stream(data)
    if structure_checked and (problem := torch_save_problem(data)) is not None:
        report.add(ERROR, "decode", f"{what} in {r.relative_path} {problem}; the item is damaged", **where)
        return
    try:
        if r.kind == TENSOR:
            t = load_tensor_bytes(data, what, r.relative_path)
            want_dtype = dtype_from_name(r.dtype)
            if tuple(t.shape) != tuple(r.sizes) or t.dtype != want_dtype:
                report.add(
                    ERROR,
                    "decode",
                    f"{what} in {r.relative_path} decodes as {t.dtype} "
                    f"{tuple(t.shape)}, but .metadata records {want_dtype} {tuple(r.sizes)}",
                    **where,
                )
                return
        elif sharded_object:
            load_object_bytes(data, f"{what} in {r.relative_path}", allow_unsafe_pickle)
        else:
            unpickle_torch(data, f"{what} in {r.relative_path}", allow_unsafe_pickle)
    except UnsafePickleError as exc:
        checked = " (its archive structure and CRC-32s were checked)" if structure_checked else ""
        report.add(WARNING, "decode", f"{what} not decoded{checked}: {exc}", **where)
        return
    except CkptdError as exc:
        report.add(ERROR, "decode", str(exc), **where)
        return
    report.items_decoded += 1


def _check_items(
    directory: Path,
    records: list[ItemRecord],
    sizes: dict[str, int],
    deep: bool,
    allow_unsafe_pickle: bool,
    sharded_objects: set[str],
    report: VerifyReport,
    progress: ProgressSink | None,
    checksum: Checksum,
) -> None:
    """Steps 5 and 6, file by file in offset order (sequential reads); ``sharded_objects``: the
    keys of the byte items that are ShardedObject shards."""
    readable = [
        r
        for r in records
        if r.relative_path in sizes
        and r.file_offset >= 0
        and r.length >= 0
        and r.file_offset + r.length <= sizes[r.relative_path]
    ]
    if progress is not None:
        progress.set_total(sum(r.length for r in readable))
    readable.sort(key=lambda r: (r.relative_path, r.file_offset))
    fds: dict[str, int] = {}
    prefetch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-verify-read")
    try:
        for r in readable:
            where = {"file": r.relative_path, "item": _item_name(r), "offset": r.file_offset, "length": r.length}
            try:
                if r.relative_path not in fds:
                    fds[r.relative_path] = open_regular(directory, r.relative_path, "data file")[0]
            except (CkptdError, FileNotFoundError) as exc:  # replaced or removed since it was checked
                report.add(ERROR, "range", f"reading {_item_name(r)} from {r.relative_path} failed: {exc}", **where)
                continue
            except OSError as exc:
                if exc.errno in _BAD_NAME_ERRNOS:
                    named = f"reading {_item_name(r)} from {r.relative_path!r}: {exc.strerror}"
                    report.add(ERROR, "range", named, **where)
                    continue
                unreadable = StorageError.reading(exc, directory / r.relative_path, "data file")
                report.add(UNREADABLE, "range", f"{unreadable} (reading {_item_name(r)})", **where)
                continue
            try:
                crc, blocks, data = _read_item(fds[r.relative_path], r, deep, progress, prefetch, checksum)
            except OSError as exc:
                what = f"{_item_name(r)} (bytes [{r.file_offset}, {r.file_offset + r.length}) of {r.relative_path})"
                if exc.errno is None:  # the file ended early: cut short since it was checked
                    report.add(ERROR, "range", f"reading {what} failed: {exc}", **where)
                    continue
                # As for a load: a local disk's EIO is damage, a network filesystem's is not.
                problem = read_error(exc, what, fds[r.relative_path])
                report.add(
                    ERROR if isinstance(problem, CorruptCheckpointError) else UNREADABLE, "range", str(problem), **where
                )
                continue
            report.bytes_read += r.length
            if r.crc is None:
                report.items_without_checksum += 1
            else:
                report.items_checksummed += 1
                bad = [k for k, (a, b) in enumerate(zip(blocks, unpack_blocks(r.block_crcs))) if a != b]
                if crc != r.crc:
                    at = f" (in the 4 MiB blocks {bad})" if bad else ""
                    report.add(
                        ERROR,
                        "checksum",
                        f"{_item_name(r)}: bytes [{r.file_offset}, {r.file_offset + r.length}) "
                        f"of {r.relative_path} have {checksum_name(checksum)} {crc:#010x}, but {r.crc:#010x} was "
                        f"recorded at save time; the item is damaged{at}",
                        **where,
                    )
                    continue  # decoding damaged bytes would only add a second error
                if bad:
                    report.add(
                        ERROR,
                        "checksum",
                        f"{_item_name(r)}: its bytes match their recorded checksum, but not the block "
                        f"checksums {bad} recorded in .metadata; the checksum table is damaged, and a load "
                        "of part of this item fails. Load with the layout it was saved with, or save anew",
                        **where,
                    )
            if deep and data is not None:
                _decode_item(r, data, allow_unsafe_pickle, r.kind != TENSOR and r.fqn in sharded_objects, report)
    finally:
        prefetch.shutdown(wait=True)
        for fd in fds.values():
            os.close(fd)


def _check_common(
    directory: Path, index: CheckpointIndex | None, has_marker: bool, allow_unsafe_pickle: bool, report: VerifyReport
) -> None:
    path = directory / COMMON_PT
    try:
        data = read_regular(directory, COMMON_PT, "common state", COMMON_PT_MAX_NBYTES)
    except FileNotFoundError:
        if has_marker:
            report.add(
                ERROR, "common", f"{COMMON_PT} is missing; every ckptd/Megatron-Core checkpoint has one", file=COMMON_PT
            )
        return
    except CkptdError as exc:  # a link, a FIFO, oversized: reported, never followed
        report.add(ERROR, "common", str(exc), file=COMMON_PT)
        return
    except OSError as exc:
        report.add(UNREADABLE, "common", str(StorageError.reading(exc, path, "common state")), file=COMMON_PT)
        return
    report.bytes_read += len(data)
    recorded = index.common_crc if index is not None else None
    if index is not None and recorded is not None:
        checksum = index.checksum or crc32c
        crc = checksum(data, 0)
        if crc != recorded:
            report.add(
                ERROR,
                "common",
                f"{COMMON_PT} ({len(data)} bytes) has {checksum_name(checksum)} {crc:#010x}, but "
                f"{recorded:#010x} was recorded at save time; the file is damaged",
                file=COMMON_PT,
                offset=0,
                length=len(data),
            )
            return
    elif is_zip_stream(data) and (problem := torch_save_problem(data)) is not None:
        # No CRC recorded (Megatron-Core, torch DCP): a flipped bit in a tensor's bytes decodes
        # without a word; the CRC-32s in the archive catch it.
        report.add(
            ERROR, "common", f"{COMMON_PT} {problem}; the file is damaged", file=COMMON_PT, offset=0, length=len(data)
        )
        return
    try:
        unpickle_torch(data, f"common state {path}", allow_unsafe_pickle)
    except UnsafePickleError as exc:
        report.add(WARNING, "common", f"{COMMON_PT} not decoded: {exc}", file=COMMON_PT)
    except CkptdError as exc:
        report.add(ERROR, "common", str(exc), file=COMMON_PT, offset=0, length=len(data))


def verify_checkpoint(
    checkpoint_dir: str | os.PathLike | S3Location,
    *,
    deep: bool = False,
    allow_unsafe_pickle: bool = False,
    progress: ProgressSink | None = None,
    read_items: bool = True,
    data_files: bool = True,
) -> VerifyReport:
    """Check one checkpoint directory end to end (see the module docstring for the checks).

    ``read_items=False`` skips steps 5 and 6 (reading every item): a structural check that costs
    a few file reads whatever the checkpoint's size, as choosing a checkpoint to resume from needs.
    ``data_files=False`` (with ``read_items=False``) skips step 4 too: a node-local disk holds only
    its node's data files, and a load reads the others (and any it cannot trust) from the mirror.

    Raises CheckpointNotFoundError only when ``checkpoint_dir`` is not a directory; every kind of
    damage is returned as an error :class:`Finding`, a file the storage failed to return as an
    unreadable one (``report.ok`` is False).
    """
    location = parse_location(checkpoint_dir)
    if isinstance(location, S3Location):
        return _verify_s3(location, deep, allow_unsafe_pickle, progress, read_items)
    directory = location
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"{directory} is not a directory")
    report = VerifyReport(str(directory), deep)
    has_marker = _check_backend(directory, report)
    index: CheckpointIndex | None = None
    try:
        index = read_index(directory, allow_unsafe_pickle)
    except UnknownClassError as exc:  # not damage: not judged either (ckptd.recovery raises it)
        report.add(UNSUPPORTED, UNKNOWN_CLASS, str(exc), file=DCP_METADATA)
    except UnsupportedFormatError as exc:
        report.add(UNSUPPORTED, "metadata", str(exc), file=DCP_METADATA)
    except CkptdError as exc:
        report.add(ERROR, "metadata", str(exc), file=DCP_METADATA)
    except OSError as exc:  # not FileNotFoundError: read_index says what a missing one means
        report.add(
            UNREADABLE,
            "metadata",
            str(StorageError.reading(exc, directory / DCP_METADATA, "DCP metadata")),
            file=DCP_METADATA,
        )
    if not has_marker:
        _check_marker_absence(directory, index, report)
    records: list[ItemRecord] | None = None
    if index is not None:
        try:
            records = with_file_ranks(records_from_index(index))
        except CkptdError as exc:
            report.add(ERROR, "metadata", f"{DCP_METADATA}: {exc}", file=DCP_METADATA)
    if index is not None and records is not None:
        report.tensors, report.objects, report.items = len(index.tensors), len(index.objects), len(records)
        _check_coverage(records, report)
        sizes = (
            _check_files(directory, records, report, _committed_sizes(directory)) if data_files or read_items else {}
        )
        if read_items:
            _check_items(
                directory,
                records,
                sizes,
                deep,
                allow_unsafe_pickle,
                # Plain torch DCP checkpoints (no marker) hold no ShardedObjects, only values.
                {k for k, o in index.objects.items() if o.sharded_object} if has_marker else set(),
                report,
                progress,
                index.checksum or crc32c,
            )
        if report.items_without_checksum:
            report.add(
                NOTE,
                "checksum",
                f"{report.items_without_checksum} of {report.items} items have no "
                "recorded checksum (written by torch DCP, Megatron-Core, or with checksums off): "
                + (
                    "the CRC-32s their torch.save archives hold were checked and they were decoded"
                    if deep
                    else "only their presence and length were checked; --deep also checks "
                    "their archives and decodes them"
                ),
            )
    _check_common(directory, index, has_marker, allow_unsafe_pickle, report)
    return report


def _verify_s3(
    location: S3Location, deep: bool, allow_unsafe_pickle: bool, progress: ProgressSink | None, read_items: bool
) -> VerifyReport:
    """:func:`verify_checkpoint` of an ``s3://`` checkpoint, through its local view (every data
    object downloaded when items are read); findings name the objects."""
    with s3_checkpoint_view(location) as view:
        if read_items:
            view.source.fetch_all()
        report = verify_checkpoint(
            view.directory, deep=deep, allow_unsafe_pickle=allow_unsafe_pickle, progress=progress, read_items=read_items
        )
    local, url = str(view.directory), str(location)
    report.checkpoint = url
    report.findings = [
        replace(f, message=f.message.replace(local, url), file=f.file.replace(local, url) if f.file else f.file)
        for f in report.findings
    ]
    return report
