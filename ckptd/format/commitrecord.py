"""The commit record: which commit of its root a checkpoint was, in commit order.

Step numbers do not order commits: a job that resumes from an older step (a rollback after a loss
spike) commits step 31 after step 40. So the coordinator writes ``ckptd_commit.json`` into each
checkpoint it commits, before the rename that commits it::

    {"seq": 5, "step": 31, "attempt": "0123456789ab-1", "committed_unix_s": 1764150000.0, "parent_seq": 2}

``seq`` is one more than the highest ``seq`` of the root's checkpoints (also of those whose markers
are gone: a number is never given twice), and no commit is numbered while a record cannot be read
(:func:`ckptd.roots.posix.next_commit_seq`). Which checkpoint is newest (the ``latest`` tracker
after a crash, ``resolve_latest``'s fallback), which ones retention keeps and which ones belong to
an abandoned branch are decided by it; checkpoints
without a record (written by ``ckptd.save``, torch DCP, Megatron-Core or ckptd before 0.2) count
as ``seq`` 0, older than any recorded commit, and among themselves by step. The wall-clock time
orders no commits (clocks are stepped, sequence numbers are not): it only tells what a job
committed before and after it loaded a step (ckptd.lineage.WentBack). torch DCP and Megatron-Core
ignore the file. ``parent_seq`` names the commit this one descends from (after a rollback to
step 30, committed as seq 2, the first commit of the new branch names 2, not the left step 40's
3): which commits are on the branch the job trains on (:mod:`ckptd.lineage`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CorruptCheckpointError, StorageError
from .safefs import read_regular

log = logging.getLogger(__name__)

COMMIT_RECORD = "ckptd_commit.json"
# The highest commit number a record may hold: far above any job's commits, and within what every
# number on the wire (msgpack's 64 bits) and in JSON (a double's exact integers) carries exactly.
MAX_COMMIT_SEQ = (1 << 53) - 1
# A record lists every data file of a node-local or S3 commit (some 50 bytes each): 64 MiB holds
# a million. Before, a local record was read with a 4 KiB limit: beyond ~80 ranks on node-local
# disks it was taken for damaged, and with it the commit order, rollbacks and the node view broke.
COMMIT_RECORD_MAX_NBYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    seq: int
    step: int
    attempt: str
    committed_unix_s: float
    # Object storage (ckptd.roots.s3_root): every object of the checkpoint, name -> {"nbytes":
    # size, "crc32c": checksum (the metadata objects)}, so that a reader checks what it reads
    # against what was committed, and knows the data objects' sizes without listing. Node-local
    # roots (ckptd.roots.nodelocal): every rank's data file, name -> {"nbytes": size}, on whichever
    # node's disk it is.
    objects: dict[str, dict[str, int]] | None = None
    # A mirror's copy only (ckptd.roots.mirror): the local commit it copies, {"seq": its seq in
    # the local root, "attempt": its attempt}, so that a resume tells which level is newer.
    source: dict[str, int | str] | None = None
    # The commit this one descends from (its seq), which a rollback does not make the one before
    # it (ckptd.lineage: which commits are on the branch the job trains on). None (not written):
    # not known (the first commit, records of older versions, ranks that loaded different steps).
    parent_seq: int | None = None

    def to_bytes(self) -> bytes:
        fields = asdict(self)
        for optional in ("objects", "source", "parent_seq"):
            if fields[optional] is None:
                del fields[optional]
        return json.dumps(fields).encode()


def read_commit_record(directory: str | os.PathLike, *, dir_fd: int | None = None) -> CommitRecord | None:
    """The commit record of a checkpoint directory; None when it has none (or an unreadable one:
    logged, and the checkpoint then counts as committed before every recorded commit). ``dir_fd``:
    the directory open already (a lease's: the record of exactly the directory leased, never of
    one renamed over its path since)."""
    try:
        return read_commit_record_checked(directory, dir_fd=dir_fd)
    except (CorruptCheckpointError, StorageError) as exc:
        log.warning("%s; ordering it before every recorded commit", exc)
        return None


def read_commit_record_checked(directory: str | os.PathLike, *, dir_fd: int | None = None) -> CommitRecord | None:
    """:func:`read_commit_record`, but a record that is there and cannot be parsed raises
    CorruptCheckpointError, and one the storage fails to return (an I/O error) StorageError: its
    checkpoint's place in commit order is unknown, which decisions that would move the tracker past
    it, take it for abandoned, retire it or number a commit after it must not guess."""
    path = Path(directory)
    try:
        raw = read_regular(path, COMMIT_RECORD, "commit record", COMMIT_RECORD_MAX_NBYTES, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StorageError.reading(exc, path / COMMIT_RECORD, "commit record") from None
    return parse_commit_record_checked(raw, path / COMMIT_RECORD)


def parse_commit_record(raw: bytes, where: object) -> CommitRecord | None:
    """A commit record's bytes read from ``where`` (named in the log); None when damaged (logged:
    the checkpoint then counts as committed before every recorded commit)."""
    try:
        return parse_commit_record_checked(raw, where)
    except CorruptCheckpointError as exc:
        log.warning("%s; ordering it before every recorded commit", exc)
        return None


def parse_commit_record_checked(raw: bytes, where: object) -> CommitRecord:
    """:func:`parse_commit_record`; a damaged record raises CorruptCheckpointError."""
    try:
        obj = json.loads(raw)
        rec = CommitRecord(
            seq=obj["seq"],
            step=obj["step"],
            attempt=obj["attempt"],
            committed_unix_s=obj["committed_unix_s"],
            objects=obj.get("objects"),
            source=obj.get("source"),
            parent_seq=obj.get("parent_seq"),
        )
        if not (
            type(rec.seq) is int
            and 0 < rec.seq <= MAX_COMMIT_SEQ
            and type(rec.step) is int
            and isinstance(rec.attempt, str)
            and isinstance(rec.committed_unix_s, (int, float))
            and (rec.objects is None or _objects_ok(rec.objects))
            and (rec.source is None or _source_ok(rec.source))
            and (rec.parent_seq is None or (type(rec.parent_seq) is int and 0 < rec.parent_seq < rec.seq))
        ):
            raise ValueError("unexpected field types")
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where} is damaged ({exc})") from None
    return rec


def _objects_ok(objects: object) -> bool:
    return isinstance(objects, dict) and all(
        isinstance(name, str)
        and isinstance(info, dict)
        and "nbytes" in info  # every reader takes an object's size from it
        and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in info.items())
        for name, info in objects.items()
    )


def _source_ok(source: object) -> bool:
    return (
        isinstance(source, dict)
        and set(source) == {"seq", "attempt"}
        and type(source["seq"]) is int
        and isinstance(source["attempt"], str)
    )


def commit_seq(directory: str | os.PathLike) -> int:
    """The directory's commit sequence number (0: no record)."""
    rec = read_commit_record(directory)
    return 0 if rec is None else rec.seq


def copied_commit(record: CommitRecord | None) -> tuple[int, str] | None:
    """The local commit a mirror's copy copies, as (its seq in the local root, its attempt); None
    for a record that is not a copy's (or no record)."""
    if record is None or record.source is None:
        return None
    return int(record.source["seq"]), str(record.source["attempt"])
