"""Listing a checkpoint root on object storage (``s3://bucket/prefix``) into the same
:class:`~ckptd.catalog.RootCatalog` a POSIX root gives.

A step "directory" ``iter_<step>/`` is COMMITTED when its commit object ``ckptd_commit.json``
exists (ckptd.roots.s3_root writes it last, create-only: it is the commit point), else PARTIAL
(an attempt in flight, or one a crash abandoned): readers trust a step only through its commit
object. The listing is one LIST of the root's "directories", one GET of ``latest`` (and of
Megatron-LM's tracker when it is there) and one GET of each step's commit object (``usage``: one
LIST of each step's objects for sizes and ages). A listing that fails
(throttling included, after the client's retries) raises StorageError: it is never read as an
empty root.
"""

from __future__ import annotations

import logging

from .catalog import (
    CheckpointEntry,
    DirUsage,
    EntryState,
    RootCatalog,
    Target,
    WentBack,
    abandoned_after,
    committed_once,
    read_tracker,
    scan_root,
)
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .format.commitrecord import (
    COMMIT_RECORD,
    COMMIT_RECORD_MAX_NBYTES,
    CommitRecord,
    commit_seq,
    copied_commit,
    parse_commit_record,
    read_commit_record,
)
from .format.layout import DCP_METADATA, METADATA_JSON
from .format.rootlayout import (
    MEGATRON_TRACKER,
    TRACKER_FILE,
    TRACKER_MAX_NBYTES,
    is_node_lock,
    megatron_tracker_name,
    parse_step_dir,
    step_dir_name,
)
from .storage.s3client import ObjectInfo, S3Client
from .storage.url import Location, S3Location

log = logging.getLogger(__name__)


# A commit object that exists but cannot be read (damaged): the step IS committed (its commit
# object was written last), of no known place in commit order (CheckpointEntry.record_problem),
# as a POSIX commit with an unreadable record; it is never taken for an abandoned attempt and removed.
DAMAGED = CommitRecord(seq=0, step=-1, attempt="", committed_unix_s=0.0)


def read_s3_commit_record(client: S3Client, step_name: str) -> CommitRecord | None:
    """The commit record of ``<root>/<step_name>``: None when it has none (not committed),
    :data:`DAMAGED` when it has one that cannot be read."""
    key = f"{step_name}/{COMMIT_RECORD}"
    try:
        got = client.get(key, COMMIT_RECORD_MAX_NBYTES, "commit record")
    except CorruptCheckpointError as exc:  # larger than any commit record
        log.warning("%s", exc)
        return DAMAGED
    if got is None:
        return None
    record = parse_commit_record(got[0], client.url(key))
    return DAMAGED if record is None else record


def read_s3_tracker(client: S3Client) -> tuple[bool, str | None, str | None, str | None]:
    """``(exists, name, problem, etag)`` of the root's ``latest`` object."""
    try:
        got = client.get(TRACKER_FILE, TRACKER_MAX_NBYTES, "tracker")
    except Exception as exc:  # noqa: BLE001 - a damaged or oversized tracker is a problem, not a crash
        return True, None, f"tracker {client.url(TRACKER_FILE)} cannot be read ({exc})", None
    if got is None:
        return False, None, None, None
    raw, etag = got
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return True, None, f"tracker {client.url(TRACKER_FILE)} is not UTF-8 text; it is damaged", etag
    if not name or "/" in name or name in (".", "..") or "\n" in name:
        return True, None, f"tracker {client.url(TRACKER_FILE)} holds {raw[:80]!r}, not a checkpoint name", etag
    return True, name, None, etag


def read_s3_megatron_tracker(client: S3Client) -> str | None:
    """:func:`~ckptd.catalog.read_megatron_tracker` of an ``s3://`` root: the directory Megatron-LM's
    tracker names, None when absent or not such text. A store that does not answer raises
    StorageError: taken for no tracker, retention could remove the checkpoint it names."""
    try:
        got = client.get(MEGATRON_TRACKER, TRACKER_MAX_NBYTES, "Megatron-LM tracker")
    except CorruptCheckpointError:  # larger than any tracker: not one
        return None
    return None if got is None else megatron_tracker_name(got[0])


def scan_s3_root(location: S3Location, client: S3Client | None = None, *, usage: bool = True) -> RootCatalog:
    client = client if client is not None else S3Client(location)
    cat = RootCatalog(location)  # type: ignore[arg-type]
    cat.tracker_exists, cat.latest_name, cat.tracker_problem, _ = read_s3_tracker(client)
    dirs, objects = client.list_dir("")
    if any(info.key == MEGATRON_TRACKER for info in objects):
        # Retention and gc keep what it names: Megatron-LM resumes from it (it lags `latest` when
        # its update failed at a commit, or a crash came before it).
        cat.megatron_latest_name = read_s3_megatron_tracker(client)
    for name in sorted(dirs):
        parsed = parse_step_dir(name)
        if parsed is None or parsed.suffix:
            cat.others.append(name)
            continue
        record = read_s3_commit_record(client, name)
        state = EntryState.COMMITTED if record is not None else EntryState.PARTIAL
        infos = list(client.list_objects(name)) if usage else []
        used = _usage(infos)
        if usage and state is EntryState.PARTIAL and used.files == 0:
            continue  # an emptied "directory" some stores (SeaweedFS) go on listing
        problem = f"{client.url(name)}/{COMMIT_RECORD} is damaged" if record is DAMAGED else None
        if state is EntryState.PARTIAL and {_relative_name(i.key) for i in infos} & {METADATA_JSON, DCP_METADATA}:
            # No attempt of a Checkpointer's: another tool's checkpoint (ckptd.save, torch DCP), or a
            # commit that stopped between its metadata and its record. Never collected as abandoned.
            problem = (
                f"{client.url(name)} has checkpoint metadata but no {COMMIT_RECORD}: another tool's checkpoint "
                "(ckptd.save, torch DCP), or a commit interrupted before its record; remove it by hand"
            )
        cat.entries.append(
            CheckpointEntry(
                name,
                location.child(name),  # type: ignore[arg-type]
                parsed.step,
                state,
                used,
                is_latest=name == cat.latest_name,
                commit_seq=record.seq if record is not None else 0,
                committed_unix_s=record.committed_unix_s if record is not None else 0.0,
                record_problem=problem,
                attempt="" if record is None else record.attempt,
                parent_seq=None if record is None else record.parent_seq,
                source=copied_commit(record),
            )
        )
    for info in objects:
        if info.key != TRACKER_FILE and not info.key.startswith(TRACKER_FILE + ".") and not is_node_lock(info.key):
            cat.others.append(info.key)
    cat.entries.sort(key=lambda e: (e.step, e.name))
    if cat.latest_name is not None and cat.tracker_problem is None:
        named = next((e for e in cat.entries if e.name == cat.latest_name), None)
        if named is None:
            cat.tracker_problem = (
                f"tracker {client.url(TRACKER_FILE)} names {cat.latest_name!r}, which does not exist; "
                "restore it or rewrite the tracker"
            )
        elif named.state is not EntryState.COMMITTED:
            cat.tracker_problem = (
                f"tracker {client.url(TRACKER_FILE)} names {cat.latest_name!r}, which has no commit "
                f"object ({COMMIT_RECORD}): it is not a committed checkpoint"
            )
    return cat


def scan_any(root: Location, *, usage: bool = True) -> RootCatalog:
    """:func:`~ckptd.catalog.scan_root` of a directory, :func:`scan_s3_root` of an ``s3://`` root."""
    if isinstance(root, S3Location):
        return scan_s3_root(root, usage=usage)
    return scan_root(root, usage=usage)


def resolve_s3_target(location: S3Location) -> Target:
    """:func:`~ckptd.catalog.resolve_target` of an ``s3://`` prefix: one checkpoint (it holds
    ``metadata.json`` or ``.metadata``), or a root (a tracker or ``iter_*`` prefixes)."""
    client = S3Client(location)
    dirs, objects = client.list_dir("")
    names = {o.key for o in objects}
    if METADATA_JSON in names or DCP_METADATA in names:
        return Target(location, is_root=False)
    if TRACKER_FILE in names or any(parse_step_dir(d) for d in dirs):
        return Target(location, is_root=True)
    raise CheckpointNotFoundError(
        f"{location} is neither a checkpoint (no {METADATA_JSON} or {DCP_METADATA} object) nor a checkpoint "
        f"root (no '{TRACKER_FILE}' object or iter_* prefixes)"
    )


def s3_checkpoint_entry(location: S3Location) -> CheckpointEntry:
    """One ``s3://`` checkpoint as a listing entry (committed when it has ``metadata.json`` or
    ``.metadata``; its size and age from one LIST)."""
    client = S3Client(location)
    _, objects = client.list_dir("")
    names = {o.key for o in objects}
    state = EntryState.COMMITTED if METADATA_JSON in names or DCP_METADATA in names else EntryState.INCOMPLETE
    used = DirUsage(
        sum(o.size for o in objects), len(objects), max((o.last_modified_unix_s for o in objects), default=0.0)
    )
    return CheckpointEntry(location.name, location, -1, state, used)  # type: ignore[arg-type]


def s3_abandoned_commit(client: S3Client, step: int, seq: int) -> bool:
    """:func:`~ckptd.catalog.abandoned_after` of an ``s3://`` root: the tracker and one commit
    object, not a listing."""
    _, name, problem, _ = read_s3_tracker(client)

    def latest_seq(n: str) -> int:
        record = read_s3_commit_record(client, n)
        return 0 if record is None else record.seq  # DAMAGED: 0

    return abandoned_after(None if problem else name, step, seq, latest_seq)


def committed_at(root: Location, step: int, went_back: WentBack | None = None) -> bool:
    """:func:`~ckptd.catalog.committed_once` of a directory or an ``s3://`` root."""
    if not isinstance(root, S3Location):
        return committed_once(root, step, went_back)
    client = S3Client(root)
    if read_s3_commit_record(client, step_dir_name(step)) is None:
        return False
    return scan_s3_root(root, client, usage=False).superseded(step, went_back) is None


def commit_record_at(root: Location, step: int) -> CommitRecord | None:
    """The commit record of ``iter_<step>`` in a directory or an ``s3://`` root (None: none)."""
    if isinstance(root, S3Location):
        return read_s3_commit_record(S3Client(root), step_dir_name(step))
    return read_commit_record(root / step_dir_name(step))


def tracked_seq(root: Location) -> int | None:
    """The commit sequence number of the checkpoint ``root``'s tracker names (0: one without a
    record); None without a tracker that names a step. A commit whose record has a higher seq is
    complete but not named latest yet (its tracker write comes last, or failed)."""
    if isinstance(root, S3Location):
        client = S3Client(root)
        name = read_s3_tracker(client)[1]
        if name is None:
            return None
        record = read_s3_commit_record(client, name)
        return 0 if record is None else record.seq
    _, name, problem = read_tracker(root)
    return None if name is None or problem is not None else commit_seq(root / name)


def checkpoint_exists(path: Location) -> bool:
    """The checkpoint directory still exists (an ``s3://`` step: its commit object does)."""
    if isinstance(path, S3Location):
        return read_s3_commit_record(S3Client(path.parent), path.name) is not None
    return path.exists()


def _relative_name(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def _usage(infos: list[ObjectInfo]) -> DirUsage:
    newest = max((i.last_modified_unix_s for i in infos), default=0.0)
    return DirUsage(sum(i.size for i in infos), len(infos), newest)
