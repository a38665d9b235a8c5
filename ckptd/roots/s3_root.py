"""A checkpoint root on S3-compatible object storage: commits by a commit-record object.

Layout under ``s3://bucket/prefix`` (the same names as a POSIX root, so torch DCP and
Megatron-Core read a committed step with ``checkpoint_id="s3://bucket/prefix/iter_0000100"``)::

    latest                                  tracker: the step committed last (compare-and-swap)
    latest_checkpointed_iteration.txt       Megatron-LM's tracker
    iter_0000100/__<rank>_0.<attempt>.distcp   data objects: the attempt is in the key
    iter_0000100/common.pt, .metadata, metadata.json   created once (If-None-Match: *)
    iter_0000100/ckptd_commit.json          THE commit point, created once, last

Order of :meth:`S3Root.commit` (the coordinator's commit thread, one step at a time):

1. validate every rank's records (global coverage); check that each rank's data object exists
   with exactly the size its writer reported (one LIST of the step);
2. a committed ``iter_<step>`` of a branch a rollback abandoned is retired first (its commit
   object deleted, then the rest); any other committed one fails the commit;
3. write ``common.pt``, ``.metadata`` and ``metadata.json`` create-only (leftovers of an aborted
   attempt of the step, never committed, are removed first; a checkpoint another tool wrote there,
   which ckptd.roots.s3_names tells apart, fails the commit instead);
4. write ``ckptd_commit.json`` create-only: the commit point. It records the commit's place in
   the root's commit order and every object's size (and the metadata objects' CRC-32C), which
   readers check. Two coordinators can never both commit a step (the second create fails);
5. move ``latest`` by compare-and-swap (``If-Match`` of the ETag read, ``If-None-Match: *`` when
   absent) to the step just committed; if that fails the commit object is deleted again and the
   commit fails (a step counts as committed once the tracker can name it: ckptd.roots.s3_tracker);
   then Megatron-LM's tracker;
6. retention: the ``keep_last`` last commits stay, and the one Megatron-LM's tracker names (an
   older one when its update failed); a removal deletes the commit object first (the
   step is invisible from then on), then the rest.

A write that failed at the client may still have been applied by the store (its response lost,
the retry then refused by the precondition, or the last try timed out). So a failed create-only
write (steps 3 and 4) is read back and counts as done when the object holds exactly the bytes
written, and a failed tracker update (step 5) is read back too (ckptd.roots.s3_tracker).

A crashed attempt has no commit object, so it is invisible; the next coordinator start (or
``ckptd gc``) removes its objects and the root's unfinished multipart uploads (a start: only
those a Checkpointer's save names so, never another tool's checkpoint; with several nodes, after
``commit_timeout_s`` unless it commits: see :meth:`S3Root.recover`). Loads cannot lease
a checkpoint against retention here (object stores have no locks): a load whose objects vanish
fails with CheckpointRemovedError and ``Checkpointer.load()`` retries on the new latest.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Mapping

from ..catalog import CheckpointEntry, EntryState, RootCatalog, WentBack, left_by, tracker_set_back
from ..errors import CheckpointExistsError, CkptdError, CorruptCheckpointError, StorageError
from ..format.checksum import crc32c
from ..format.commitrecord import COMMIT_RECORD, CommitRecord
from ..format.dcp_pickle import metadata_pickle
from ..format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON, backend_metadata_bytes
from ..format.records import ItemRecord
from ..format.rootlayout import (
    MEGATRON_TRACKER,
    TRACKER_FILE,
    megatron_tracker_bytes,
    parse_step_dir,
    step_dir_name,
)
from ..format.validate import validate_records
from ..recovery import structural_problem
from ..retention import GcPlan, Removal, plan_gc
from ..s3catalog import read_s3_commit_record, read_s3_tracker, s3_abandoned_commit, scan_s3_root
from ..storage.s3client import S3Client, Upload
from ..storage.url import S3Location
from .base import CommitOutcome, Recovery
from .posix import committed_once_advice, next_commit_seq, rollback_warnings
from .s3_data import S3DataTarget, s3_data_file_name
from .s3_names import (
    METADATA_OBJECTS,
    attempt_of,
    ckptd_named,
    foreign_checkpoint,
    leaf,
    removable,
    retired,
    step_attempt_of,
    why_kept,
)
from .s3_tracker import point_tracker, point_tracker_at_commit

log = logging.getLogger(__name__)


class S3Root:
    def __init__(
        self,
        location: S3Location,
        *,
        keep_last: int = 0,
        megatron_tracker: bool = True,
        client: S3Client | None = None,
    ) -> None:
        self.location = location
        self.keep_last = keep_last
        self.megatron_tracker = megatron_tracker
        self.client = client if client is not None else S3Client(location)
        # (step, attempt) whose commit object's write failed without an answer: the store may still
        # apply it (a request it holds), so the abort that follows leaves its objects to `ckptd gc`.
        self._commit_unknown: set[tuple[int, str]] = set()

    def __repr__(self) -> str:
        return f"S3Root({self.location})"

    def display(self, *parts: str) -> str:
        return self.location.url(*parts)

    # --- writing ----------------------------------------------------------------------------------
    def data_file_name(self, attempt: str, rank: int) -> str:
        return s3_data_file_name(attempt, rank)

    def data_target(self, step: int, attempt: str, rank: int) -> S3DataTarget:
        return S3DataTarget(self.client, step_dir_name(step), s3_data_file_name(attempt, rank), (step, attempt))

    # --- committing -------------------------------------------------------------------------------
    def commit(
        self,
        step: int,
        attempt: str,
        records: list[ItemRecord],
        common: bytes,
        data_files: Mapping[str, tuple[int, int]],
        *,
        source: dict[str, int | str] | None = None,
        source_chain: frozenset[tuple[int, str]] = frozenset(),
        elsewhere: frozenset[str] = frozenset(),
        went_back: WentBack | None = None,
        went_back_agreed: bool = True,
        seq_floor: int = 0,
    ) -> CommitOutcome:
        """``source``: the local commit a mirror's copy is of (ckptd.roots.mirror), recorded in
        the commit record; ``source_chain``: see :meth:`RootCatalog.copy_parent`. ``elsewhere`` is
        ignored: every node's objects are in the store, and all are checked. Others: see
        :meth:`RootStore.commit`."""
        name = step_dir_name(step)
        cat = self.scan(usage=False)
        replaced = None
        damage = None
        if any(e.name == name for e in cat.committed):
            replaced = cat.superseded(step, went_back if source is None else None)
            if replaced is None and source is not None:
                replaced = self._copy_of_another_commit(cat, name, source)
            if replaced is None and source is None and not cat.left_between(step, went_back):
                # Damaged (an object lost): a job that resumed from the step before saves it again.
                damage = self._damage(name)
                replaced = next(e for e in cat.committed if e.name == name) if damage is not None else None
            if replaced is None:
                raise CheckpointExistsError(
                    f"{self.display(name)} is committed already; {committed_once_advice(cat, step, went_back)}"
                )
        validate_records(records)
        objects, listed = self._check_data_objects(name, data_files)
        if replaced is not None:
            self._retire(name, keep_attempt=attempt)
        else:
            theirs = foreign_checkpoint(listed)
            if theirs:  # as a directory root refuses a step directory that exists
                shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
                raise CheckpointExistsError(
                    f"{self.display(name)} holds a checkpoint ckptd did not commit: no {COMMIT_RECORD}, and objects "
                    f"no Checkpointer's save wrote ({shown}), so another tool's (ckptd.save, torch DCP). ckptd never "
                    f"replaces it: save under another step, or move or delete {self.display(name)} first"
                )
            # An aborted or crashed attempt's metadata objects, only those listed: another writer's
            # created since then fails the create-only writes below instead of being replaced.
            self.client.delete([f"{name}/{n}" for n in METADATA_OBJECTS if n in listed])
        meta = metadata_pickle(records, self.display(name), crc32c(common), protocol=pickle.HIGHEST_PROTOCOL)
        for obj_name, data in ((COMMON_PT, common), (DCP_METADATA, meta), (METADATA_JSON, backend_metadata_bytes())):
            try:
                self.client.create(f"{name}/{obj_name}", data, if_unknown="if it was, the attempt's removal removes it")
            except FileExistsError:
                raise CheckpointExistsError(
                    f"{self.display(name, obj_name)} was created by another writer while attempt {attempt} committed "
                    f"the step (another tool or job saving to {self.location}?); nothing of it was replaced: save "
                    "under another step"
                ) from None
            objects[obj_name] = {"nbytes": len(data), "crc32c": crc32c(data)}
        parent = (
            cat.copy_parent(source_chain, step) if source else cat.parent_of(step, went_back, agreed=went_back_agreed)
        )
        record = CommitRecord(
            seq=next_commit_seq(cat, seq_floor, self.location),
            step=step,
            attempt=attempt,
            committed_unix_s=time.time(),
            objects=objects,
            source=source,
            parent_seq=None if parent is None else parent.commit_seq,
        )
        try:
            self.client.create(  # the commit point
                f"{name}/{COMMIT_RECORD}",
                record.to_bytes(),
                if_unknown=f"if it was, {name} is committed though this save fails, and the next coordinator "
                "start names it latest",
            )
        except FileExistsError:
            raise CheckpointExistsError(
                f"{self.display(name)} was committed by someone else meanwhile: its {COMMIT_RECORD} is not "
                f"attempt {attempt}'s; is another job saving to {self.location}?"
            ) from None
        except StorageError:
            self._commit_unknown.add((step, attempt))
            raise
        point_tracker_at_commit(self.client, self.location, name)
        if self.megatron_tracker and step > 0:
            try:
                self.client.put(MEGATRON_TRACKER, megatron_tracker_bytes(step))
            except StorageError as exc:  # a convenience for Megatron-LM; ckptd's own tracker is written
                log.warning("committed %s, but %s could not be updated: %s", name, MEGATRON_TRACKER, exc)
        left = cat.left_by_commit(step, record.seq, parent)
        warnings = rollback_warnings(cat, step, name, replaced is not None, damage, went_back, parent, left)
        for text in warnings:
            log.warning("%s", text)
        if self.keep_last > 0:
            self._apply_retention()
        return CommitOutcome(name=name, warnings=warnings)

    def _copy_of_another_commit(
        self, cat: RootCatalog, name: str, source: dict[str, int | str]
    ) -> CheckpointEntry | None:
        """A mirror's committed ``name`` when it copies another local commit of the step than
        ``source``: the local root replaced that one (a re-save after a rollback the mirror did not
        see, its copies having lagged), so the newer copy replaces it as the local commit did."""
        record = read_s3_commit_record(self.client, name)
        if record is None or record.source is None or record.source == source:
            return None
        return next((e for e in cat.committed if e.name == name), None)

    def _check_data_objects(
        self, name: str, data_files: Mapping[str, tuple[int, int]]
    ) -> tuple[dict[str, dict[str, int]], set[str]]:
        """Every rank's data object exists with the size its writer reported (one LIST); returns
        them as the commit record lists them, and the names of the step's objects."""
        _, found = self.client.list_dir(name)
        sizes = {info.key.rsplit("/", 1)[-1]: info.size for info in found}
        for file_name, (rank, nbytes) in sorted(data_files.items(), key=lambda kv: kv[1][0]):
            size = sizes.get(file_name)
            if size is None:
                raise CorruptCheckpointError(
                    f"rank {rank}'s data object {self.display(name, file_name)} is missing, though its "
                    "node reported it written; the step is not committed"
                )
            if size != nbytes:
                raise CorruptCheckpointError(
                    f"rank {rank}'s data object {self.display(name, file_name)} has {size} bytes, its "
                    f"writer reported {nbytes}; the step is not committed"
                )
        return {file_name: {"nbytes": nbytes} for file_name, (_, nbytes) in data_files.items()}, set(sizes)

    def name_latest(self, name: str) -> None:
        """Point ``latest`` at the committed ``name`` (compare-and-swap): a mirror whose copy of
        the local latest committed but whose tracker update failed (ckptd.daemon.mirror)."""
        point_tracker(self.client, self.location, name)

    # --- removing -----------------------------------------------------------------------------------
    def abort(self, step: int, attempt: str) -> None:
        """Remove the attempt's data objects and unfinished uploads; its metadata objects too when
        the step is not committed (a committed step's belong to the attempt that committed it)."""
        name = step_dir_name(step)
        if (step, attempt) in self._commit_unknown:
            # Removed now, a commit object the store applies later would name a checkpoint without
            # its objects; left, the checkpoint is whole if it does (and `ckptd gc` removes them
            # once the grace period passed if it does not).
            log.warning(
                "not removing the aborted save %s of attempt %s: its commit object's write got no answer "
                "and may still be applied (`ckptd gc` removes it if it is not)",
                self.display(name),
                attempt,
            )
            return
        try:
            record = read_s3_commit_record(self.client, name)
            if record is not None and record.attempt == attempt:
                # This attempt committed: its objects are the checkpoint, never junk (a report
                # answered after the commit asks to remove a late writer's files, which on object
                # storage are the committed ones; or a coordinator died after its commit object
                # and a node that lost it aborted locally).
                log.info("not removing %s: attempt %s committed it", self.display(name), attempt)
                return
            _, found = self.client.list_dir(name)
            mine = [i.key for i in found if attempt_of(i.key) == attempt]
            if record is None and all(ckptd_named(i.key) for i in found):
                # Never next to an object another tool named: the metadata may be its checkpoint's
                # (the commit refused to replace it), or one it is writing (ckptd.roots.s3_names).
                mine += [f"{name}/{n}" for n in METADATA_OBJECTS]
            self.client.delete(mine)
            for upload in self.client.uploads(name):
                if attempt_of(upload.key) == attempt:
                    self.client.abort_upload(upload)
        except (StorageError, CorruptCheckpointError) as exc:
            log.warning(
                "could not remove the aborted save %s (`ckptd gc` removes it later): %s", self.display(name), exc
            )

    def _retire(
        self, name: str, keep_attempt: str | None = None, only_attempt: str | None = None, *, racing: bool = False
    ) -> None:
        """Remove a committed step: its commit object first (invisible from then on), then its other
        objects: but the data objects of ``keep_attempt`` (a save about to replace it), and with
        ``only_attempt`` (the retired commit's) only that attempt's data objects (a re-save of the
        step may be uploading its own meanwhile). ``racing``: another process (the job, for
        ``ckptd gc``) may commit the step again meanwhile; the metadata objects, named alike by
        every commit of the step, then go only as old as the retired commit object (the store's
        clock), so a new commit's stay. The job's own retention and commits run one at a time on
        its commit thread and take them all: a store's clocks may differ by a little across its
        gateways, and a metadata object left behind would fail the next commit's create."""
        record_key = f"{name}/{COMMIT_RECORD}"
        written_by = math.inf
        if racing:
            # Dated as a listing dates it (to the millisecond; a HEAD's date is to the second).
            listed = self.client.list_objects(name)
            record = next((i for i in listed if i.key == record_key), None)
            if record is not None and record.last_modified_unix_s:
                written_by = record.last_modified_unix_s
        self.client.delete([record_key])
        doomed = [
            i.key
            for i in self.client.list_objects(name)
            if retired(i.key, keep_attempt, only_attempt)
            and (attempt_of(i.key) is not None or i.last_modified_unix_s <= written_by)
        ]
        self.client.delete(doomed)

    def changed_since_scan(self, entry: CheckpointEntry) -> str | None:
        """Why the committed ``entry`` of a scan is no longer the one under its name (the tracker
        names it now, or its commit object is another commit's: a re-save after a rollback), or
        None. A store has no lock: a commit between this and the removal is the race left."""
        if entry.state is not EntryState.COMMITTED:
            if read_s3_commit_record(self.client, entry.name) is not None:
                return f"{self.display(entry.name)} was committed since the scan"
            return None
        if read_s3_tracker(self.client)[1] == entry.name:
            return f"{self.display(entry.name)} is named latest now"
        record = read_s3_commit_record(self.client, entry.name)
        if record is not None and record.seq != entry.commit_seq:
            return f"{self.display(entry.name)} was committed again since the scan"
        if record is None and entry.record_problem is None:
            # Retired since: a re-save of the step retires the commit it replaces before it
            # writes its own metadata, and its data objects are in the store already.
            return f"{self.display(entry.name)} was retired since the scan (a save of the step may be replacing it)"
        return None

    def remove_entry(
        self, entry: CheckpointEntry, *, written_before_unix_s: float = math.inf, racing: bool = False
    ) -> bool:
        """Retention and gc: remove a committed or partial step and its unfinished uploads; False
        when there was nothing (a store that lists emptied "directories", as SeaweedFS does). Of a
        partial step, only what was written (uploads: begun) before ``written_before_unix_s``,
        never a commit object: a save of the step may have begun since ``ckptd gc`` found it
        abandoned. ``racing``: see :meth:`_retire` (``ckptd gc``)."""
        only = None
        if entry.state is EntryState.COMMITTED:
            record = read_s3_commit_record(self.client, entry.name)
            if racing and record is None and entry.record_problem is None:
                # Retired since the scan, by a re-save of the step (see changed_since_scan):
                # retiring "every attempt" now would take the re-save's data objects.
                log.info("gc: %s was retired since the scan; left to the save replacing it", self.display(entry.name))
                return False
            only = record.attempt if record is not None and record.attempt else None  # DAMAGED: every attempt
            self._retire(entry.name, only_attempt=only, racing=racing)
            found = True
        else:
            keys = [
                i.key
                for i in self.client.list_objects(entry.name)
                if i.last_modified_unix_s < written_before_unix_s and i.key.rsplit("/", 1)[-1] != COMMIT_RECORD
            ]
            self.client.delete(keys)
            found = bool(keys)
        for upload in self.client.uploads(entry.name):
            begun_before = entry.state is EntryState.COMMITTED or upload.initiated_unix_s < written_before_unix_s
            if retired(upload.key, None, only) and begun_before:
                self.client.abort_upload(upload)
                found = True
        return found

    def _apply_retention(self) -> None:
        try:
            plan = plan_gc(self.scan(usage=False), self.keep_last, grace_s=math.inf)
            if plan.refused:
                log.warning("retention skipped: %s", plan.refused)
                return
            for removal in plan.remove:
                if removal.entry.state is EntryState.COMMITTED:
                    self.remove_entry(removal.entry)
                    log.info("retention: removed %s (%s)", self.display(removal.entry.name), removal.reason)
        except (StorageError, CkptdError) as exc:
            log.warning("retention in %s failed: %s", self.location, exc)

    # --- state ------------------------------------------------------------------------------------
    def holds_commit(self, step: int, attempt: str, went_back: WentBack | None = None) -> bool:
        record = read_s3_commit_record(self.client, step_dir_name(step))
        if record is None or record.step != step or record.attempt != attempt:  # DAMAGED: step -1
            return False
        if left_by(went_back, step, record.committed_unix_s):
            return False
        return not s3_abandoned_commit(self.client, step, record.seq)

    def committed_once(self, step: int, went_back: WentBack | None = None) -> bool:
        """Committed, on the current branch, not one a job that ``went_back`` left, and
        structurally intact (see :meth:`commit`)."""
        if read_s3_commit_record(self.client, step_dir_name(step)) is None:
            return False
        cat = self.scan(usage=False)
        if cat.superseded(step, went_back) is not None:
            return False
        if cat.left_between(step, went_back):
            return True  # not replaced, damaged or not (see commit)
        try:
            return self._damage(step_dir_name(step)) is None
        except CkptdError:  # removed meanwhile, or the store did not answer: the commit decides again
            return False

    def _damage(self, name: str) -> str | None:
        """What is wrong with the committed ``name``: its small objects and metadata, or a data
        object its commit record lists that is missing or of another size (the structural check
        lists them: one LIST); its data objects' bytes are not read (a store keeps its own checksums)."""
        if read_s3_commit_record(self.client, name) is None:
            return None  # not ckptd's commit: never replaced (ckptd.roots.posix.damaged_commit)
        return structural_problem(self.location.child(name), damage_only=True)

    def recover(self, *, nnodes: int) -> Recovery:
        """Name the last commit in the tracker if a crash came between its commit object and the
        tracker; then, with one node, remove every uncommitted attempt's objects and unfinished
        uploads (nothing can be in flight), or with several nodes adopt the attempts of
        uncommitted steps, found by their objects or their unfinished uploads (another node may
        still be writing them; each is aborted after commit_timeout_s unless it commits). Only
        what a Checkpointer names so (ckptd.roots.s3_names): a checkpoint another tool wrote into
        the root (ckptd.save, torch DCP) is kept, and named in ``kept``."""
        cat = self.scan(usage=False)
        finished = None
        current = cat.latest()
        # A tracked commit whose record is damaged has no known place in commit order: none is
        # known to be newer (ckptd.roots.posix.finish_interrupted_commit).
        tracker = self.client.head(TRACKER_FILE) if cat.tracker_exists else None
        set_back = tracker_set_back(cat, tracker.last_modified_unix_s if tracker is not None else None)
        if set_back is not None:
            log.warning("%s: %s", self.location, set_back)
        elif not (cat.tracker_exists and (cat.tracker_problem is not None or current is None)) and (
            current is None or current.record_problem is None
        ):
            newest = next((e for e in cat.newest_first if e.record_problem is None), None)
            if newest is not None and (current is None or newest.commit_order > current.commit_order):
                point_tracker(self.client, self.location, newest.name)
                finished = newest.name
        partial = [
            (e, [i.key for i in self.client.list_objects(e.name) if leaf(i.key) != COMMIT_RECORD])
            for e in cat.entries
            if e.state is EntryState.PARTIAL
        ]
        kept = [why for e, keys in partial if (why := why_kept(self.display(e.name), keys)) is not None]
        if nnodes > 1:
            adopted = {(e.step, a) for e, keys in partial for k in keys if (a := attempt_of(k))}
            # Also one known only by its unfinished uploads (a job killed while every rank was
            # uploading): its abort aborts them, which a store otherwise keeps (and bills) for ever.
            committed = {e.step for e in cat.entries if e.state is EntryState.COMMITTED}
            uploading = (step_attempt_of(u.key) for u in self.leftover_uploads())
            adopted.update(key for key in uploading if key is not None and key[0] not in committed)
            return Recovery(finished=finished, adopted=sorted(adopted), kept=kept)
        removed = []
        for e, keys in partial:
            doomed = removable(keys)
            self.client.delete(doomed)
            if doomed:
                whole = len(doomed) == len(keys)
                removed.append(self.display(e.name) if whole else f"the attempts' objects of {self.display(e.name)}")
        for upload in self.leftover_uploads():
            if attempt_of(upload.key) is not None:  # another tool's save may still be uploading its own
                self.client.abort_upload(upload)
                removed.append(f"an unfinished upload of {self.display(upload.key)}")
        return Recovery(finished=finished, removed=removed, kept=kept)

    def leftover_uploads(self) -> list[Upload]:
        """The unfinished multipart uploads of this root's step directories (a crash's). Others are
        not ckptd's: under a bucket-level root (``s3://bucket``) they are any application's."""
        return [u for u in self.client.uploads("") if parse_step_dir(u.key.split("/", 1)[0]) is not None]

    def scan(self, *, usage: bool = True) -> RootCatalog:
        return scan_s3_root(self.location, self.client, usage=usage)

    def highest_commit_seq(self) -> int:
        return self.scan(usage=False).highest_commit_seq

    def checkpoint_location(self, step: int) -> S3Location:
        return self.location.child(step_dir_name(step))


def apply_s3_gc(root: S3Root, plan: GcPlan, grace_s: float) -> list[tuple[Removal, str | None]]:
    """``ckptd gc`` of an ``s3://`` root: carry out ``plan`` (each removal retires the commit object
    first), then abort the root's unfinished multipart uploads older than ``grace_s`` (a crashed
    writer's: the store keeps and bills them forever otherwise). Returns each removal with None or
    the error that stopped it."""
    done: list[tuple[Removal, str | None]] = []
    cutoff = time.time() - grace_s
    for removal in list(plan.remove):
        changed = plan.stale(removal, read_s3_tracker(root.client)[1], lambda: root.scan(usage=False))
        changed = changed or root.changed_since_scan(removal.entry)
        if changed is not None:  # a rollback moved the tracker, or the job committed the step again
            log.info("gc: kept %s for now: %s; a later collection decides", root.display(removal.entry.name), changed)
            plan.remove.remove(removal)
            plan.kept.append((removal.entry, f"{changed}; a later collection decides"))
            continue
        try:
            root.remove_entry(removal.entry, written_before_unix_s=cutoff, racing=True)
        except CkptdError as exc:
            done.append((removal, str(exc)))
        else:
            done.append((removal, None))
    for upload in root.leftover_uploads():
        if upload.initiated_unix_s <= cutoff:
            root.client.abort_upload(upload)
            log.info("gc: aborted the unfinished upload of %s", root.display(upload.key))
    return done
