"""Reading items back from data files, with checks that name the damaged file."""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import torch

from ..errors import CheckpointNotFoundError, CkptdError, CorruptCheckpointError, StorageError, UnsafePickleError
from .archive import decode_problem, is_zip_stream, torch_save_problem
from .checksum import Checksum, checksum_name
from .layout import COMMON_PT, COMMON_PT_MAX_NBYTES, METADATA_JSON
from .safefs import entry_exists, open_regular

if TYPE_CHECKING:
    from .dcp_metadata import CheckpointIndex, StoredObject


class RangeSource(Protocol):
    """Where the bytes of a checkpoint's data files come from when they are not all on disk yet:
    a checkpoint on object storage read through a local view (ckptd.storage.s3view), or a commit
    of node-local disks whose other nodes' files are in a mirror (ckptd.storage.nodeview). A
    reader opens a data file through :meth:`open_file` first, calls :meth:`ensure` before it reads
    a range of it, and may say in advance which ranges it will read (:meth:`prefetch`)."""

    def open_file(self, relative_path: str) -> tuple[int, int] | None:
        """``(fd, size)`` of a data file the source keeps outside the view's directory (the
        caller closes ``fd``); None: the file of that name in the view's directory."""
        ...

    def ensure(self, relative_path: str, offset: int, length: int) -> None: ...

    def prefetch(self, ranges: list[tuple[str, int, int]]) -> None: ...


class DataFiles:
    """Open data files of one checkpoint, kept open while a load runs.

    Usage: ``with DataFiles(dir) as files: files.read(rel_path, offset, length)``. With a
    ``source`` (a view of a checkpoint on object storage or on node-local disks), a file is opened
    where the source keeps it, and every range is fetched before it is read: :meth:`read` does it,
    a reader using :meth:`fileno_and_size` calls :meth:`ensure`.
    """

    def __init__(self, directory: str | os.PathLike, source: RangeSource | None = None) -> None:
        self.directory = Path(directory)
        self.source = source
        self._open: dict[str, tuple[BinaryIO, int]] = {}
        self._dir_fd = -1

    def ensure(self, relative_path: str, offset: int, length: int) -> None:
        if self.source is not None:
            self.source.ensure(relative_path, offset, length)

    def prefetch(self, ranges: list[tuple[str, int, int]]) -> None:
        if self.source is not None:
            self.source.prefetch(ranges)

    def __enter__(self) -> DataFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for f, _ in self._open.values():
            f.close()
        self._open.clear()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def _file(self, relative_path: str) -> tuple[BinaryIO, int]:
        if relative_path not in self._open:
            # Only regular files inside the directory (ckptd.format.safefs): a link, a FIFO or a
            # name reaching outside is a CorruptCheckpointError, never followed or waited on.
            if self._dir_fd < 0:
                try:
                    self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except (FileNotFoundError, NotADirectoryError):
                    raise CheckpointNotFoundError(
                        f"checkpoint directory {self.directory} is gone (removed or renamed while it "
                        "was being read, e.g. by retention or ckptd gc); load another checkpoint"
                    ) from None
            try:
                opened = self.source.open_file(relative_path) if self.source is not None else None
                fd, size = (
                    opened
                    if opened is not None
                    else open_regular(self.directory, relative_path, "data file", dir_fd=self._dir_fd)
                )
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"data file {self.directory / relative_path} is missing; the checkpoint is "
                    "incomplete. Load an earlier checkpoint, or restore the file."
                ) from None
            self._open[relative_path] = (os.fdopen(fd, "rb"), size)
        return self._open[relative_path]

    def fileno_and_size(self, relative_path: str) -> tuple[int, int]:
        """OS file descriptor (for positional reads) and size of an open data file."""
        f, size = self._file(relative_path)
        return f.fileno(), size

    def read(self, relative_path: str, offset: int, length: int, what: str) -> bytes:
        f, size = self._file(relative_path)
        if offset >= 0 and length >= 0 and offset + length <= size:
            self.ensure(relative_path, offset, length)
        if offset < 0 or length < 0 or offset + length > size:
            raise CorruptCheckpointError(
                f"data file {self.directory / relative_path} is truncated: {what} needs bytes "
                f"[{offset}, {offset + length}) but the file has {size}. Load an earlier checkpoint."
            )
        try:
            f.seek(offset)
            data = f.read(length)
        except OSError as exc:
            where = f"{what} (bytes [{offset}, {offset + length}) of {self.directory / relative_path})"
            raise read_error(exc, where, f.fileno()) from exc
        if len(data) != length:
            raise CorruptCheckpointError(f"short read of {what} from {self.directory / relative_path}")
        return data


# Filesystems whose EIO is as often a server's or the network's fault as a disk's.
_NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "9p", "gpfs", "beegfs", "afs"}
)
# What a local filesystem answers for bytes it cannot return: a bad sector or its own checksum
# failing (btrfs: EIO; ZFS: EBADE, its ECKSUM), or its structures damaged (EUCLEAN).
_DAMAGE_ERRNOS = frozenset({errno.EIO, errno.EUCLEAN, errno.EBADE})


def read_error(exc: OSError, what: str, fd: int) -> CkptdError:
    """The error for ``exc`` raised reading ``what`` (naming item, file and byte range) through
    ``fd``. On a local disk an I/O error is damage (CorruptCheckpointError), which a resume falls
    back past as past a checksum mismatch. On a network filesystem or a FUSE mount, or for any
    other error, it is a StorageError, which stops the resume instead: taking the newest
    checkpoint for damaged there would resume an older step, after which the next commit leaves
    the newer ones on an abandoned branch for retention to remove."""
    name = f"{exc.strerror or exc}, {errno.errorcode.get(exc.errno or 0, '?')}"
    fstype = filesystem_type(fd)
    local = fstype is not None and fstype not in _NETWORK_FILESYSTEMS and not fstype.startswith("fuse")
    if exc.errno in _DAMAGE_ERRNOS and local:
        return CorruptCheckpointError(
            f"{what}: the disk could not return its bytes ({name}, on {fstype}): the checkpoint is damaged. "
            "Load an earlier checkpoint; check the disk (dmesg, the filesystem's scrub)"
        )
    return StorageError(
        f"{what}: reading it failed ({name}, on {fstype or 'a filesystem /proc/self/mountinfo does not name'}). "
        "A network filesystem's fault: load again once it is back. A damaged disk (dmesg tells): load an "
        "earlier checkpoint (load(step=N))"
    )


def filesystem_type(fd: int) -> str | None:
    """The type of the filesystem ``fd`` is on (``/proc/self/mountinfo``), None when unknown."""
    try:
        dev = os.fstat(fd).st_dev
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(dev)}:{os.minor(dev)}".encode()
    for line in lines:
        fields, _, rest = line.partition(b" - ")
        parts = fields.split()
        if len(parts) > 2 and parts[2] == want and rest:
            return rest.split()[0].decode(errors="replace")
    return None


def check_checksum(data: Any, recorded: int | None, checksum: Checksum | None, what: str) -> None:
    """Raise CorruptCheckpointError unless ``data`` (an item's bytes, any buffer) has the checksum
    recorded at save time (nothing to check when none was recorded). ``what`` names the item, its
    file and byte range."""
    if recorded is not None and checksum is not None:
        checksum_mismatch(checksum(data, 0), recorded, checksum, what)


def checksum_mismatch(crc: int, recorded: int, checksum: Checksum, what: str) -> None:
    """Raise CorruptCheckpointError when the computed ``crc`` differs from the ``recorded`` one."""
    if crc != recorded:
        raise CorruptCheckpointError(
            f"{what} has {checksum_name(checksum)} {crc:#010x}, but {recorded:#010x} was recorded at "
            "save time: the checkpoint is damaged (bit rot, or changed on disk). Load an earlier "
            "checkpoint; ckptd verify lists every damaged item."
        )


def _decode(stream: BinaryIO, what: str, weights_only: bool) -> Any:
    """``torch.load`` of ``stream`` once :func:`ckptd.format.archive.decode_problem` found nothing
    that would make decoding allocate more than the stream's bytes."""
    try:
        problem = decode_problem(stream)
    except OSError as exc:
        raise CorruptCheckpointError(f"{what} cannot be read ({exc})") from exc
    if problem is not None:
        raise CorruptCheckpointError(
            f"{what} {problem}; the file is damaged or was not written by torch.save. Load an earlier checkpoint."
        )
    stream.seek(0)
    return torch.load(stream, map_location="cpu", weights_only=weights_only)


def load_tensor_bytes(data: bytes, what: str, where: str) -> torch.Tensor:
    try:
        t = _decode(io.BytesIO(data), f"{what} in {where}", True)
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{what} in {where} cannot be decoded ({exc}); the file is damaged") from exc
    if not isinstance(t, torch.Tensor):
        raise CorruptCheckpointError(f"{what} in {where} holds a {type(t).__name__}, not a tensor")
    return t


def unpickle_torch(data: bytes | BinaryIO, what: str, allow_unsafe_pickle: bool) -> Any:
    """``torch.load`` with ``weights_only=True`` unless the caller opted into arbitrary pickles;
    first the archive is checked so that decoding allocates no more than its bytes (see
    :func:`ckptd.format.archive.decode_problem`)."""
    stream = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        return _decode(stream, what, not allow_unsafe_pickle)
    except CorruptCheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        if allow_unsafe_pickle:
            raise CorruptCheckpointError(f"{what} cannot be decoded ({exc})") from exc
        # torch's message is a page of advice; keep the name of the refused global.
        found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
        culprit = found.group(1) if found else "objects"
        raise UnsafePickleError(
            f"{what} contains {culprit}, which is outside torch's weights-only allow-list, so "
            "loading it could run arbitrary code. If you trust this checkpoint, pass "
            "allow_unsafe_pickle=True (or allow-list the class with "
            "torch.serialization.add_safe_globals)."
        ) from exc
    except Exception as exc:
        raise CorruptCheckpointError(f"{what} cannot be decoded ({exc!r}); the file is damaged") from exc


def load_object_bytes(data: bytes, what: str, allow_unsafe_pickle: bool) -> Any:
    """A ShardedObject item: ``torch.save([obj])``."""
    value = unpickle_torch(data, what, allow_unsafe_pickle)
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    raise CorruptCheckpointError(f"{what} does not hold a one-element list as Megatron-Core writes")


def read_common_pt(
    directory: str | os.PathLike,
    allow_unsafe_pickle: bool = False,
    *,
    expected: bool | None = None,
    crc: int | None = None,
    checksum: Checksum | None = None,
) -> Any:
    """``common.pt`` (rank 0's common state), or None for a plain torch DCP checkpoint, which has
    neither it nor ``metadata.json``.

    ``expected``: whether the checkpoint has one, as known from what was read when it was opened
    (``metadata.json`` present); a missing ``common.pt`` is then damage (or, if the directory went
    away meanwhile, :class:`~ckptd.errors.CheckpointNotFoundError`) and is never mistaken for a
    plain DCP checkpoint. None: decided now from ``metadata.json``. ``crc``/``checksum``: the
    checksum recorded at save time, checked before anything is decoded.
    """
    root = Path(directory)
    path = root / COMMON_PT
    try:
        fd, size = open_regular(root, COMMON_PT, "common state", COMMON_PT_MAX_NBYTES)
    except (FileNotFoundError, NotADirectoryError):
        fd = -1
    if fd >= 0:
        with os.fdopen(fd, "rb") as f:
            if crc is not None and checksum is not None:
                checksum_mismatch(_file_checksum(f, size, checksum, path), crc, checksum, f"{path} ({size} bytes)")
                return unpickle_torch(f, f"common state {path}", allow_unsafe_pickle)
            # No checksum recorded (Megatron-Core, torch DCP): the CRC-32s in the archive catch a
            # flipped bit in a tensor of the common state, which decodes without a word.
            if is_zip_stream(f.read(4)) and (problem := decode_problem(f, check_crcs=True)) is not None:
                raise CorruptCheckpointError(
                    f"{path} {problem}; the checkpoint's common state is damaged. Restore the file, or "
                    "load an earlier checkpoint"
                )
            f.seek(0)  # streamed, checked and decoded alike: never read whole into memory
            return unpickle_torch(f, f"common state {path}", allow_unsafe_pickle)
    if not root.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint directory {root} is gone (removed or renamed while it was being read, e.g. by "
            "retention or ckptd gc); load another checkpoint"
        )
    if expected if expected is not None else entry_exists(root, METADATA_JSON):
        raise CorruptCheckpointError(
            f"{path} is missing, but {root / METADATA_JSON} says the checkpoint has one; the "
            "checkpoint is damaged. Restore the file, or load an earlier checkpoint."
        )
    return None


def _file_checksum(f: BinaryIO, size: int, checksum: Checksum, path: Path) -> int:
    """The checksum of the open file's ``size`` bytes, read in blocks; then back at its start."""
    buf = memoryview(bytearray(min(size, 16 << 20)))
    crc = done = 0
    while done < size:
        n = f.readinto(buf[: min(len(buf), size - done)])  # type: ignore[attr-defined]
        if not n:
            raise CorruptCheckpointError(f"{path} shrank while being read ({done} of {size} bytes)")
        crc = checksum(buf[:n], crc)
        done += n
    f.seek(0)
    return crc


def read_object_item(files: DataFiles, obj: StoredObject, what: str, checksum: Checksum | None) -> bytes:
    """The bytes of a bytes item (a ShardedObject or a DCP value), checked against the checksum
    recorded at save time, or else against the CRC-32s of its ``torch.save`` archive."""
    raw = files.read(obj.relative_path, obj.file_offset, obj.length, what)
    where = (
        f"{what} (bytes [{obj.file_offset}, {obj.file_offset + obj.length}) of {files.directory / obj.relative_path})"
    )
    check_checksum(raw, obj.crc, checksum, where)
    if (
        (obj.crc is None or checksum is None)
        and is_zip_stream(raw)
        and (problem := torch_save_problem(raw)) is not None
    ):
        # No checksum recorded (torch DCP, Megatron-Core): the archive's own CRC-32s catch bit rot.
        raise CorruptCheckpointError(f"{where} {problem}; the item is damaged: load an earlier checkpoint")
    return raw


def read_bytes_item(
    files: DataFiles, obj: StoredObject, allow_unsafe_pickle: bool, checksum: Checksum | None = None
) -> Any:
    """A DCP bytes item (``torch.save(value)``), checked (see :func:`read_object_item`), decoded."""
    what = f"the value '{obj.fqn}' in {files.directory / obj.relative_path}"
    return unpickle_torch(read_object_item(files, obj, f"the value '{obj.fqn}'", checksum), what, allow_unsafe_pickle)


def read_common(
    directory: str | os.PathLike,
    allow_unsafe_pickle: bool = False,
    index: CheckpointIndex | None = None,
    source: RangeSource | None = None,
) -> Any:
    """The whole common (non-sharded) state: ``common.pt`` plus the DCP bytes items.

    ``common.pt`` holds it for Megatron-style saves; torch DCP (and ckptd for DCP-style state dicts)
    stores non-tensor values as bytes items instead, which are nested again along DCP's
    ``planner_data`` (``{"step": 5, "opt": {"lr": 0.1}}`` saved by DCP reads as it was saved).
    Every value is decoded: pass ``allow_unsafe_pickle`` for objects outside torch's weights-only
    allow-list (loads decode only what they are asked for, see :mod:`ckptd.loading.loader`).
    """
    from ..statedict.tree import set_path
    from .dcp_metadata import common_items, planner_path, read_index

    root = Path(directory)
    if index is None:
        index = read_index(root, allow_unsafe_pickle)
    common = read_common_pt(root, allow_unsafe_pickle, crc=index.common_crc, checksum=index.checksum)
    out = common if common is not None else {}
    items = common_items(index)
    if not items:
        return out
    if not isinstance(out, dict):
        raise CorruptCheckpointError(
            f"{root / COMMON_PT} holds a {type(out).__name__}, not a dict, so the checkpoint's "
            f"other values ({', '.join(o.fqn for o in items[:3])}...) cannot be added to it"
        )
    with DataFiles(root, source) as files:
        for obj in items:
            value = read_bytes_item(files, obj, allow_unsafe_pickle, index.checksum)
            set_path(out, planner_path(index, obj.fqn), value)
    return out
