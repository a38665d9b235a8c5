"""Two tiers: a local root (node-local disk or a shared filesystem) mirrored to an ``s3://`` root.

Saves commit to the local root as without a mirror (the rename is the commit point, at disk
speed); the coordinator's daemon then copies each committed step into the mirror in the
background, where it is committed as any object-store save is (a commit object written last,
``latest`` moved by compare-and-swap; ckptd.roots.s3_root). The two levels commit separately:
"committed" on the local level means "renamed into place and durable on that disk", on the
mirror level "its commit object exists", which may come seconds to minutes later, or never for
a step a newer one overtook.

Order of one mirror upload (the mirror thread of the coordinator's daemon, ckptd.daemon.mirror):

1. :func:`next_upload` compares the local root's latest commit with the commit the mirror's
   latest copies (its commit record's ``source``): only the newest local commit is ever copied,
   so a mirror that lags behind frequent saves skips steps rather than queueing them;
2. :func:`mirror_step` takes a read lease on the local step directory (retention leaves it in
   place meanwhile) and reads every file through the lease's directory fd: it streams each data
   file into a new data object whose key names a fresh mirror attempt, checking every item's
   CRC-32C against ``.metadata`` on the way (a local bit flip is refused, never copied), and
   commits the copy with the local step's records and common state, unless the directory was
   replaced meanwhile (a re-save of the step after a rollback: the next upload copies that
   commit); its commit record names the local commit in ``source``;
3. a failed upload removes its objects (:meth:`S3Root.abort`) and is retried after
   :data:`RETRY_AFTER_S`, or at once when a newer step commits locally.

On node-local disks of several nodes (``node_local``) no root holds every data file: step 2 is
then a copy round in which every node uploads its own files and node 0 commits
(ckptd.roots.mirror_nodes); steps 1 and 3 are the same.

A resume picks the level with :func:`resume_level`: the local root's latest intact commit,
unless the mirror's latest copy is of a later commit (in the local root's commit order, where the
two levels provably share a history; else by step: a replaced node, a lost disk), or the ranks do
not all see the same local checkpoint (a shared root seen differently): then the mirror. A local
copy found damaged thus gives way to the mirror's intact copy of the same commit. With node-local
disks (config ``node_local``) the local candidate is node 0's latest commit (:func:`resume_from`),
read on each node from its disk and the mirror (ckptd.storage.nodeview). :func:`copies_commit`
tells whether the mirror's copy of a step is of the local commit of that step (``wait_mirrored``).
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from io import FileIO
from pathlib import Path
from typing import TYPE_CHECKING

from ..catalog import scan_root
from ..errors import CkptdError, CorruptCheckpointError, StorageError
from ..format.checksum import Checksum, crc32c
from ..format.commitrecord import CommitRecord, read_commit_record
from ..format.durable import atomic_write_bytes
from ..format.layout import COMMON_PT, COMMON_PT_MAX_NBYTES, DCP_METADATA
from ..format.lease import ReadLease
from ..format.records import ItemRecord
from ..format.rootlayout import MIRRORED_FILE, step_dir_name
from ..format.safefs import Dir, open_regular, read_regular
from ..s3catalog import read_s3_commit_record, read_s3_tracker
from ..storage.objwriter import ObjectSink
from .base import CommitOutcome
from .s3_data import s3_data_file_name
from .s3_root import S3Root

if TYPE_CHECKING:
    from ..format.dcp_metadata import CheckpointIndex

log = logging.getLogger(__name__)

LOCAL = "local"
MIRROR = "mirror"
RETRY_AFTER_S = 30.0
_CHUNK_NBYTES = 8 << 20


@dataclass(frozen=True, kw_only=True)
class CommitRef:
    """One commit of the local root: its step, attempt and place in the root's commit order."""

    step: int
    attempt: str
    seq: int

    def source(self) -> dict[str, int | str]:
        return {"seq": self.seq, "attempt": self.attempt}

    @classmethod
    def of_record(cls, record: CommitRecord | None) -> CommitRef | None:
        """The commit a local commit record is (None: no record)."""
        return None if record is None else cls(step=record.step, attempt=record.attempt, seq=record.seq)

    @classmethod
    def copied_by(cls, record: CommitRecord | None) -> CommitRef | None:
        """The local commit a mirror's commit record is a copy of (None: no record, or not a copy)."""
        if record is None or record.source is None:
            return None
        return cls(step=record.step, attempt=str(record.source["attempt"]), seq=int(record.source["seq"]))


@dataclass(frozen=True, kw_only=True)
class FailedUpload:
    commit: CommitRef
    retry_at_s: float  # monotonic


def next_upload(
    local: CommitRef | None, mirrored: CommitRef | None, failed: FailedUpload | None, now_s: float
) -> CommitRef | None:
    """The local commit to copy now, or None: the local latest, unless the mirror's latest is a
    copy of it, or its last upload failed less than :data:`RETRY_AFTER_S` ago."""
    if local is None or mirrored == local:
        return None
    if failed is not None and failed.commit == local and now_s < failed.retry_at_s:
        return None
    return local


def resume_level(
    local: CommitRef | None,
    mirrored: CommitRef | None,
    *,
    local_holds_mirrored: bool,
    mirror_holds_local: bool = False,
    same_on_every_rank: bool = True,
) -> str:
    """:data:`LOCAL` or :data:`MIRROR`: where a job resumes from.

    ``local``: the local root's latest intact commit (an older one when the newer ones are
    damaged); ``mirrored``: the local commit the mirror's latest intact copy copies (its record's
    ``source``); ``local_holds_mirrored``: the local root holds that commit (its commit record,
    intact or not); ``mirror_holds_local``: the mirror holds a copy of a commit of the local root,
    committed before its latest copy (one committed after it is a replaced disk's first commit);
    ``same_on_every_rank``: every rank found this ``local`` (node-local disks of a replaced node
    do not).

    Either holding proves that the local root is the one the mirror copies, so both ``seq`` are
    of its commit order: the later commit wins (a rollback the local root records after the
    mirror's copy; a local copy of the mirror's commit found damaged, or a local root restored
    from before a rollback, resumes the mirror's copy). Without that proof the seqs may be of two
    histories (a replaced node's new disk numbers its commits from 1 again), and the higher step
    wins: a local root that holds only older steps (a lost or replaced disk) resumes from the
    mirror, one that saved on after resuming from the mirror resumes its own.
    """
    if mirrored is None:
        return LOCAL
    if local is None or not same_on_every_rank:
        return MIRROR
    if (local_holds_mirrored or mirror_holds_local) and local.attempt and mirrored.attempt:
        return LOCAL if local.seq >= mirrored.seq else MIRROR
    return LOCAL if local.step >= mirrored.step else MIRROR


def orders_disagree(local: CommitRef | None, mirrored: CommitRef | None) -> bool:
    """Whether the step and the commit order tell :func:`resume_level` different levels (both
    commits known): only then does it need to know whether the levels share a history."""
    if local is None or mirrored is None or not local.attempt or not mirrored.attempt:
        return False
    return (local.step >= mirrored.step) != (local.seq >= mirrored.seq)


def copies_commit(
    copied: CommitRef | None, local: CommitRef | None, *, left_behind_locally: bool, local_may_lag: bool = False
) -> bool:
    """Whether a committed mirror copy of a step holds what the local root committed as that step
    (``wait_mirrored``): ``copied`` is the local commit the copy copies (its record's ``source``;
    None: not a copy of a local commit), ``local`` the commit of the step the local root holds
    (None: none with a commit record, e.g. retention removed it).

    A copy of another commit of the step is not (the mirror copied the step before a rollback
    and the step was saved again: the mirror copies only the newest local commit, so it may
    never copy this one). Without a local commit to compare with, a copy counts unless the local
    root's tracker shows a rollback left it behind (``left_behind_locally``). ``local_may_lag``:
    ``local`` is a node's disk other than node 0's (node-local disks), which may hold an older
    commit of the step than node 0's, the commit authority: a copy of a later commit counts too.
    """
    if copied is None:
        return local is None
    if local is None:
        return not left_behind_locally
    return copied == local or (local_may_lag and copied.seq > local.seq)


@dataclass(frozen=True, kw_only=True)
class LocalFind:
    """What one rank found in its local root: its latest intact commit, whether that root still
    holds the commit the mirror's latest copies, and whether the mirror holds a copy of one of its
    commits, committed before that latest copy (``copied``; asked only where the step and the
    commit order disagree, see :func:`resume_level`). Gathered from every rank for a resume (a few bytes)."""

    commit: CommitRef | None
    holds_mirrored: bool
    copied: bool = False


def resume_from(
    found: Sequence[LocalFind], mirrored: CommitRef | None, *, node_local: bool, rank: int = 0
) -> tuple[str, CommitRef | None]:
    """Where the ranks resume from, from what each found locally (``found``, by rank) and the local
    commit the mirror's latest copies: :data:`LOCAL` or :data:`MIRROR` (:func:`resume_level`), and
    the commit of that level (LOCAL: the one to load; MIRROR: ``mirrored``).

    A shared local root (``node_local`` False): ``rank``'s own find; when the ranks found different
    commits, the oldest of them (there for every rank), and the mirror when one found none.
    Node-local disks: node 0's root is the commit authority (its daemon
    commits), so every rank resumes from rank 0's find; a node whose disk lags behind (its daemon
    died before it renamed the last commit into place) or holds nothing (a replaced node) reads
    what it lacks from the mirror's copy of that commit, instead of rolling every rank back to an
    older copy. Only a node 0 that lost its commits (a replaced node 0) resumes from the mirror.
    """
    mine = found[0] if node_local else found[rank]
    same = node_local or len({f.commit for f in found}) == 1
    if not same and all(f.commit is not None for f in found):
        # A shared root the ranks read at different moments (a commit finishing meanwhile, a
        # filesystem's cache): the oldest commit they found is there for every one of them, and
        # the mirror wins only where it is newer. Taking the mirror whatever its age rolled a job
        # back, silently, to a copy hours old.
        mine, same = min(found, key=lambda f: (f.commit.seq, f.commit.step) if f.commit is not None else (0, 0)), True
    level = resume_level(
        mine.commit,
        mirrored,
        local_holds_mirrored=mine.holds_mirrored,
        mirror_holds_local=mine.copied,
        same_on_every_rank=same,
    )
    return level, (mine.commit if level == LOCAL else mirrored)


def local_latest(root: Path) -> CommitRef | None:
    """The commit the local root's tracker names; None when there is none, no tracker to trust,
    or the checkpoint is not a Checkpointer's commit (no commit record: ``ckptd.save``, DCP)."""
    entry = scan_root(root, usage=False).latest()
    return CommitRef.of_record(None if entry is None else read_commit_record(entry.path))


def mirrored_latest(mirror: S3Root) -> CommitRef | None:
    """The local commit the mirror's latest checkpoint is a copy of (None: none, or not a copy)."""
    _, name, _, _ = read_s3_tracker(mirror.client)
    if name is None:
        return None
    return CommitRef.copied_by(read_s3_commit_record(mirror.client, name))


def local_chain(root: Path, commit: CommitRef) -> frozenset[tuple[int, str]]:
    """``commit`` and its known ancestors in the local root (their seqs there: ckptd.lineage): the
    mirror's copy of it descends from the newest copy of one of them, so the mirror's retention
    and fallback keep to the branch the job trains on as the local root's do."""
    return scan_root(root, usage=False).chain_of(commit.seq)


def new_mirror_attempt(commit: CommitRef) -> str:
    """A fresh attempt id for one upload: data object keys are never reused, not even by a retry."""
    return f"{commit.attempt or 'x'}-m{secrets.token_hex(4)}"


def mirror_step(root: Path, commit: CommitRef, mirror: S3Root) -> CommitOutcome:
    """Copy the committed local ``iter_<step>`` of ``commit`` into ``mirror`` and commit it there
    (steps 2-3 of the module docstring). Raises CkptdError naming the file or object:
    CorruptCheckpointError when the local files are damaged (no retry can succeed), StorageError
    for the store; nothing of a failed copy stays in the mirror.

    Every file is read through the lease's directory fd: a re-save of the step after a rollback
    renames its commit over this one whatever the lease (ckptd.roots.posix.publish_step), and a
    read by path could then mix the two attempts' files. A copy whose directory was replaced
    meanwhile is not committed (:func:`check_still_leased`); the next copy takes the new commit."""
    name = step_dir_name(commit.step)
    attempt = new_mirror_attempt(commit)
    with ReadLease.acquire(root / name) as lease:
        try:
            records, checksum, common = read_local_commit(lease, commit)
            try:
                renamed, data_files = _upload_data(lease, records, checksum, name, attempt, mirror)
                check_still_leased(lease, commit)
                try:
                    outcome = mirror.commit(
                        commit.step,
                        attempt,
                        renamed,
                        common,
                        data_files,
                        source=commit.source(),
                        source_chain=local_chain(root, commit),
                    )
                except CorruptCheckpointError as exc:  # an uploaded object missing or resized: the store's doing
                    raise StorageError(f"committing the copy of step {commit.step} failed: {exc}") from exc
            except BaseException:
                mirror.abort(commit.step, attempt)
                raise
        except (CkptdError, OSError) as exc:
            if lease.gone():  # its files went with it (an unlink, a truncated read): say why
                raise replaced_while_copied(lease, commit) from exc
            raise
        note_mirrored(root, name)  # under the lease: retention cannot take the step before the marker names it
        return outcome


def replaced_while_copied(lease: ReadLease, commit: CommitRef) -> CkptdError:
    """The error of a copy whose local directory was replaced (or removed) while it was read."""
    return CkptdError(
        f"{lease.directory} was replaced while the mirror copied it (commit {commit.attempt} of step "
        f"{commit.step}, seq {commit.seq}: a re-save of the step after a rollback, or a removal by hand); "
        "nothing of this copy was committed to the mirror, and the mirror copies the local root's newest "
        "commit next"
    )


def check_still_leased(lease: ReadLease, commit: CommitRef) -> None:
    """Raise :func:`replaced_while_copied` when the leased directory no longer is where it was: the
    copy is not committed then (its files were read through the lease, but the local root has
    moved on to another commit of the step, which the next copy takes)."""
    if lease.gone():
        raise replaced_while_copied(lease, commit)


def note_mirrored(root: Path, name: str) -> bool:
    """Name ``name`` in the local root's :data:`~ckptd.format.rootlayout.MIRRORED_FILE`: the step
    the mirror's latest copies, which retention keeps until a newer one is mirrored (a resume
    after a rollback then finds it locally and knows the local branch is newer). False, logged,
    when it cannot be written (retention then keeps the previous one)."""
    try:
        with Dir.open(root) as rootd:
            atomic_write_bytes(rootd.entry(MIRRORED_FILE), f"{name}\n".encode())
    except OSError as exc:
        log.warning("mirror: could not note %s as mirrored in %s: %s", name, root / MIRRORED_FILE, exc)
        return False
    return True


def leased_commit_record(lease: ReadLease) -> CommitRecord | None:
    """The commit record of the leased directory, read through its fd (None: none, or damaged)."""
    return read_commit_record(lease.directory, dir_fd=lease.fd)


def read_local_commit(lease: ReadLease, commit: CommitRef) -> tuple[list[ItemRecord], Checksum | None, bytes]:
    """The records (with their ranks), checksum function and ``common.pt`` of the committed leased
    directory, read through the lease's fd, which must still be ``commit`` (a CkptdError
    otherwise); ``common.pt`` is checked against its recorded checksum."""
    directory = lease.directory
    record = leased_commit_record(lease)
    if record is None or (record.step, record.attempt, record.seq) != (commit.step, commit.attempt, commit.seq):
        raise CkptdError(
            f"{directory} is no longer the commit {commit.attempt} of step {commit.step} (replaced by a newer "
            "save of the step); the mirror copies the newer one next"
        )
    from ..format.dcp_metadata import records_from_index  # torch: see _read_leased_index

    index = _read_leased_index(lease)
    records = _ranked(records_from_index(index))
    common = _read_leased(lease, COMMON_PT, "common state", COMMON_PT_MAX_NBYTES)
    recorded = index.common_crc
    if index.checksum is not None and recorded is not None and index.checksum(common, 0) != recorded:
        raise CorruptCheckpointError(
            f"{directory / COMMON_PT} no longer matches its recorded checksum (bit rot on the local disk?); "
            "it is not copied to the mirror. Run `ckptd verify` on the checkpoint."
        )
    return records, index.checksum, common


def _read_leased(lease: ReadLease, name: str, what: str, max_nbytes: int) -> bytes:
    """The whole file ``name`` of the leased directory (at most ``max_nbytes`` long), opened
    through its fd (messages name the directory's path)."""
    try:
        return read_regular(lease.directory, name, what, max_nbytes, dir_fd=lease.fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise StorageError.from_oserror(exc, str(lease.directory / name)) from exc


def _read_leased_index(lease: ReadLease) -> CheckpointIndex:
    """``.metadata`` of the leased directory. ``read_index`` opens a path, so it is given the
    directory as its fd names it (``/proc/self/fd/<fd>``, where that names it: Linux with /proc);
    elsewhere the directory's path, which :func:`check_still_leased` vouches for only afterwards.
    Messages name the directory's path either way."""
    # .metadata is read with DCP's classes: the daemon imports torch here, on its first
    # upload, and only when a mirror is configured (README: Daemon memory).
    from ..format.dcp_metadata import read_index

    held = Path(f"/proc/self/fd/{lease.fd}")
    try:
        by_fd = os.path.samestat(os.stat(held), os.fstat(lease.fd))
    except OSError:
        by_fd = False
    if not by_fd:
        return read_index(lease.directory)
    try:
        return read_index(held)
    except CkptdError as exc:
        kind = CorruptCheckpointError if isinstance(exc, CorruptCheckpointError) else CkptdError
        raise kind(str(exc).replace(str(held), str(lease.directory))) from exc
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(lease.directory / DCP_METADATA)) from exc


def _ranked(records: list[ItemRecord]) -> list[ItemRecord]:
    """``records`` with the rank their data file's name gives; only ckptd's layout is mirrored."""
    from ..format.dcp_metadata import with_file_ranks  # torch: see mirror_step

    out = with_file_ranks(records)
    for r in out:
        if r.rank < 0:
            raise CorruptCheckpointError(
                f"{r.where()} is stored in {r.relative_path!r}, not in a data file of ckptd's layout "
                "(__<rank>_<n>.distcp); only ckptd's own commits are mirrored"
            )
    return out


def _upload_data(
    lease: ReadLease, records: list[ItemRecord], checksum: Checksum | None, name: str, attempt: str, mirror: S3Root
) -> tuple[list[ItemRecord], dict[str, tuple[int, int]]]:
    """Upload every data file the records name, checking each item against its recorded
    ``checksum``; returns the records pointing at the new objects (with the CRC-32C of each item,
    which the mirror's ``.metadata`` records) and ``{object name: (rank, nbytes)}``."""
    by_file: dict[str, list[ItemRecord]] = {}
    for r in records:
        by_file.setdefault(r.relative_path, []).append(r)
    renamed: list[ItemRecord] = []
    data_files: dict[str, tuple[int, int]] = {}
    for rel, items in sorted(by_file.items()):
        rank = items[0].rank
        target = s3_data_file_name(attempt, rank)
        ordered = sorted(items, key=lambda r: r.file_offset)
        nbytes, crcs = copy_checked(lease.directory, rel, ordered, checksum, mirror, f"{name}/{target}", lease.fd)
        data_files[target] = (rank, nbytes)
        renamed += [replace(r, relative_path=target, crc=crc) for r, crc in zip(ordered, crcs, strict=True)]
    return renamed, data_files


def copy_checked(
    directory: Path,
    rel: str,
    items: list[ItemRecord],
    checksum: Checksum | None,
    mirror: S3Root,
    key: str,
    dir_fd: int | None = None,
) -> tuple[int, list[int]]:
    """Stream ``directory/rel`` into object ``key``; every item (in file order) with a recorded
    checksum is checked on the way. Returns the bytes copied and each item's CRC-32C. ``dir_fd``:
    ``directory`` open already (a lease's), so that a rename of the directory meanwhile does not
    matter."""
    path = directory / rel
    fd, size = open_regular(directory, rel, "data file", dir_fd=dir_fd)
    crcs: list[int] = []
    try:
        with FileIO(fd, "rb", closefd=False) as f, ObjectSink(mirror.client, key, object_nbytes=size) as sink:
            pos = 0
            for item in items:
                end = item.file_offset + item.length
                if item.file_offset < pos or end > size:
                    raise CorruptCheckpointError(
                        f"{item.where()} is recorded at bytes [{item.file_offset}, {end}) of {path}, which has "
                        f"{size} bytes (or overlaps the item before it); the checkpoint is damaged and is not "
                        "mirrored. Run `ckptd verify` on it."
                    )
                _copy(f, sink, item.file_offset - pos, path)
                check = checksum if item.crc is not None and checksum not in (None, crc32c) else None
                crc, recorded = _copy(f, sink, item.length, path, check)
                if item.crc is not None and checksum is not None and (recorded if check else crc) != item.crc:
                    raise CorruptCheckpointError(
                        f"{item.where()} in {path} no longer matches its recorded checksum (bit rot on the local "
                        "disk?); it is not copied to the mirror. Run `ckptd verify` on the checkpoint."
                    )
                crcs.append(crc)
                pos = end
            _copy(f, sink, size - pos, path)
        return size, crcs
    except OSError as exc:
        raise StorageError.from_oserror(exc, str(path)) from exc
    finally:
        os.close(fd)


def _copy(f: FileIO, sink: ObjectSink, nbytes: int, path: Path, other: Checksum | None = None) -> tuple[int, int]:
    """Copy ``nbytes`` from ``f``'s position into ``sink``: ``(CRC-32C, other checksum or 0)`` of
    the bytes copied."""
    buf = bytearray(min(nbytes, _CHUNK_NBYTES))
    view = memoryview(buf)
    crc = alt = 0
    left = nbytes
    while left > 0:
        n = f.readinto(view[: min(left, len(buf))])
        if not n:
            raise CorruptCheckpointError(f"{path} ended {left} bytes early while it was mirrored; it was truncated")
        sink.write(view[:n])
        crc = crc32c(view[:n], crc)
        if other is not None:
            alt = other(view[:n], alt)
        left -= n
    return crc, alt
