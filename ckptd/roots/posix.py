"""The commit of one step in a POSIX root (the rename is the commit point), its recovery after a
crash, and the tracker files of a checkpoint root.

Order of :func:`commit_step` (runs on the coordinator's commit thread, one step at a time):

Each attempt of a step is written into its own ``<step>.<attempt>.tmp`` directory (attempt ids:
ckptd.control.attempt), so files of two attempts never meet in one directory.

1. ``finalize``: validate global coverage of all ranks' records (errors name key and ranks),
   write ``common.pt``, ``.metadata`` and ``metadata.json`` in ``<step>.<attempt>.tmp/`` (each
   tmp + fsync + rename, directory fsynced), then the commit record (its place in the root's
   commit order, :mod:`ckptd.format.commitrecord`);
2. check that every rank's data file is there, a regular file of exactly the size its writer
   reported (at least what its records address), then rename ``<step>.<attempt>.tmp`` ->
   ``<step>`` and fsync the root (after removing ``*.part`` files of writers killed mid-write).
   A message can therefore never commit a checkpoint that does not load. For a crash the rename
   is the point of no return:
   should the coordinator die now, its successor finishes the commit at its start
   (:func:`finish_interrupted_commit`); a coordinator that lives undoes it if step 3 fails.
   A committed ``<step>`` of a branch a rollback abandoned (:meth:`RootCatalog.abandoned`) is
   renamed to ``<step>.deleting`` first and removed after step 3; any other committed
   ``<step>`` fails the commit (a step is committed once);
3. replace the ``latest`` tracker atomically with the step just committed (also when it is older
   than committed steps: the job went back, and a restart must resume where it went; the ranks
   are told so in the outcome's warnings), then Megatron-LM's
   ``latest_checkpointed_iteration.txt`` likewise, except for step 0, which Megatron-LM refuses
   (see :func:`write_megatron_tracker`; its failure is only logged). If ``latest`` cannot be
   written (disk full...), the directory is renamed back to ``<step>.<attempt>.tmp`` and the
   commit fails: a step counts as committed once the tracker can name it, and its ranks must
   never be told otherwise;
4. retention: keep the ``keep_last`` last committed checkpoints in commit order (and always the
   tracker's), removing older ones via ``*.deleting`` (:mod:`ckptd.retention`).

A failure before step 2 leaves no committed directory: the caller aborts and removes the tmp dir.
Failures in step 4 are logged, never turned into an abort (the checkpoint is already committed).
"""

from __future__ import annotations

import logging
import math
import os
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..catalog import (
    CheckpointEntry,
    EntryState,
    RootCatalog,
    WentBack,
    read_tracker,
    scan_root,
    tracker_set_back,
)
from ..errors import CheckpointExistsError, CkptdError, CorruptCheckpointError, StorageError, UnknownClassError
from ..format.commitrecord import COMMIT_RECORD, MAX_COMMIT_SEQ, CommitRecord, read_commit_record
from ..format.durable import Opener, atomic_write_bytes, default_opener
from ..format.finalize import finalize
from ..format.layout import DCP_METADATA, METADATA_JSON
from ..format.records import ItemRecord
from ..format.rootlayout import (
    MEGATRON_TRACKER,
    TRACKER_FILE,
    committed_step,
    deleting_name,
    is_part_file,
    megatron_tracker_bytes,
    parse_step_dir,
    step_dir_name,
    tmp_dir_name,
    tracker_bytes,
)
from ..format.safefs import Dir, is_real_dir
from ..recovery import structural_problem
from ..retention import apply_gc, plan_gc
from .base import CommitOutcome

log = logging.getLogger(__name__)


def tracker_step(root: Path) -> int | None:
    """The step the ``latest`` tracker names, or None (no tracker, or not a step's name)."""
    _, name, _ = read_tracker(root)
    return committed_step(name or "")


def next_commit_seq(cat: RootCatalog, seq_floor: int, where: object) -> int:
    """The number of the next commit into the root ``cat`` lists: above every commit there and
    above ``seq_floor``. CorruptCheckpointError when it would pass what a record may hold (a
    record of an impossible number, which no scan would take for a commit again).

    A commit record that is there but cannot be read fails the commit (nothing of it is visible
    yet): its number may be the highest, and a commit that repeated it was ordered by step against
    it, so that after a rollback the step the job left passed for the newest commit (retention then
    removed the step it went back to, and a daemon start pointed the tracker at the left one).
    StorageError when the storage failed to return it (the next save tries again), else
    CorruptCheckpointError (until it is restored, or its checkpoint moved out of the root)."""
    unknown = cat.unknown_commit_number()
    if unknown is not None:
        why = (
            f"{where}: the commit record of {unknown.name} cannot be read ({unknown.record_problem}), so the "
            "number of this commit is unknown: one that repeated its number would be ordered against it by "
            "step, and after a rollback the step left behind would pass for the newest commit. The save fails"
        )
        if unknown.record_unreadable:
            raise StorageError(
                f"{why}; the next save tries again, and each fails so until the record can be read (make it "
                "readable for this user, or mend the filesystem)"
            )
        raise CorruptCheckpointError(
            f"{why}, and so does every save into this root until {unknown.path}/{COMMIT_RECORD} is restored "
            f"from a backup, or {unknown.name} is moved out of the root (ckptd never removes it)"
        )
    seq = 1 + max(seq_floor, cat.highest_commit_seq)
    if seq > MAX_COMMIT_SEQ:
        raise CorruptCheckpointError(
            f"{where}: the next commit number would be {seq}, beyond {MAX_COMMIT_SEQ}: a checkpoint of this root, "
            "or of a node's disk, records an impossible commit number (tampered, or another tool's); remove it"
        )
    return seq


def commit_step(
    root: Path,
    step: int,
    attempt: str,
    records: list[ItemRecord],
    common: bytes,
    data_files: Mapping[str, tuple[int, int]],
    *,
    fsync: bool,
    keep_last: int,
    megatron_tracker: bool,
    opener: Opener = default_opener,
    elsewhere: frozenset[str] = frozenset(),
    node_local: bool = False,
    went_back: WentBack | None = None,
    went_back_agreed: bool = True,
    seq_floor: int = 0,
) -> CommitOutcome:
    """Commit ``<root>/<step>.<attempt>.tmp`` (see the module docstring).

    ``data_files``: every rank's data file name -> ``(rank, bytes its writer reported)``;
    ``elsewhere``: those on other nodes' disks (a node-local root, ckptd.roots.nodelocal), which
    are not checked here; ``node_local``: the commit record lists every data file's size, and the
    outcome carries the files written (for the other nodes: ckptd.roots.nodelocal), and the commit
    is numbered above ``seq_floor`` too (the other nodes' disks' highest number: a replaced disk
    would number from 1 again, below their commits of the old one, which would then pass for the
    newest). ``went_back``, ``went_back_agreed``: what the job's ranks last loaded, which the
    commit descends from (its record's ``parent_seq``: ckptd.lineage), and whose left steps it
    replaces (not on node-local disks: the other nodes' copies of a step replaced that way would
    stay). Every
    file is written relative to the root's and the step directory's fds, the step directory is
    opened without following a link (a planted link fails the commit with StorageError naming
    it), and trackers replace their entry, never write through a link.
    """
    name = step_dir_name(step)
    tmp = tmp_dir_name(step, attempt)
    final = root / name
    cat = scan_root(root, usage=False)
    left_to_replace = None if node_local else went_back
    with Dir.open(root) as rootd:
        replaced = None
        damage = None
        if rootd.lstat(name) is not None:
            replaced = cat.superseded(step, left_to_replace)
            if replaced is None and not node_local and not cat.left_between(step, went_back):
                replaced, damage = damaged_commit(cat, name, final)
            if replaced is None:
                advice = committed_once_advice(cat, step, left_to_replace)
                raise CheckpointExistsError(f"{final} already exists; {advice}")
        if rootd.lstat(tmp) is None:
            raise CkptdError(f"{root / tmp} vanished before the commit (removed by gc or by hand?)")
        parent = cat.parent_of(step, went_back, agreed=went_back_agreed)
        record = CommitRecord(
            seq=next_commit_seq(cat, seq_floor, root),
            step=step,
            attempt=attempt,
            committed_unix_s=time.time(),
            objects={n: {"nbytes": nbytes} for n, (_, nbytes) in data_files.items()} if node_local else None,
            parent_seq=None if parent is None else parent.commit_seq,
        )
        with rootd.subdir(tmp) as tmpd:
            remove_partial_files(tmpd)
            written = finalize(tmpd, records, common, opener, fsync, checkpoint_id=str(final))
            written[COMMIT_RECORD] = record.to_bytes()
            atomic_write_bytes(tmpd.entry(COMMIT_RECORD), written[COMMIT_RECORD], opener, fsync)
            check_data_files(tmpd, {n: v for n, v in data_files.items() if n not in elsewhere})
        untracked = publish_step(
            rootd,
            step,
            tmp,
            replaced=replaced is not None,
            fsync=fsync,
            opener=opener,
            megatron_tracker=megatron_tracker,
        )
    left = cat.left_by_commit(step, record.seq, parent)
    warnings = rollback_warnings(cat, step, name, replaced is not None, damage, left_to_replace, parent, left)
    for text in warnings:
        log.warning("%s", text)
    if untracked is not None:
        warnings += (untracked,)
    elif keep_last > 0:  # not while latest names the step before: it is by the tracker's branch
        apply_retention(root, keep_last)
    return CommitOutcome(name=name, warnings=warnings, files=written if node_local else {})


def publish_step(
    rootd: Dir, step: int, tmp: str, *, replaced: bool, fsync: bool, opener: Opener, megatron_tracker: bool
) -> str | None:
    """Steps 2 (from the rename) and 3 of :func:`commit_step` for the complete attempt directory
    ``tmp`` of ``rootd``: rename it to ``iter_<step>`` (a ``replaced`` committed one goes to
    ``*.deleting`` first and is removed after), fsync the root, point the trackers at it; the
    rename is undone when ``latest`` cannot name it (re-raised). Returns a warning when it could
    not be undone either: the checkpoint is committed (the rename is the point of no return, and
    the next coordinator start names it latest), so its ranks are told so, with the warning; told
    it aborted, node-local peers removed their files of it, and a resume loaded it all the same."""
    name = step_dir_name(step)
    doomed = deleting_name(name)
    if replaced:
        if rootd.lstat(doomed) is not None:
            rootd.remove_tree(doomed)  # an earlier interrupted removal of the same step
        rootd.rename(name, doomed)
    try:
        rootd.rename(tmp, name)
    except BaseException:
        if replaced:  # the replaced checkpoint goes back (a tracker, Megatron-LM's too, may name it)
            _undo_rename(rootd, doomed, name, fsync)
        raise
    try:
        if fsync:
            rootd.fsync()
        # Always the step just committed, also after a rollback: it is what a restart resumes.
        atomic_write_bytes(rootd.entry(TRACKER_FILE), tracker_bytes(name), opener, fsync)
    except BaseException as exc:
        if tracker_step(rootd.path) != step:
            if not _undo_rename(rootd, name, tmp, fsync):
                if not isinstance(exc, Exception):
                    raise
                warning = (
                    f"{rootd.path / name} is committed, complete and in place, but the tracker {TRACKER_FILE} "
                    f"could not name it ({exc}) and it could not be taken back either: until the next commit or "
                    "daemon start (which makes it latest), latest() names the step before; fix the storage "
                    "of the root"
                )
                log.error("%s", warning)
                return warning
            if replaced:
                _undo_rename(rootd, doomed, name, fsync)
            raise
        log.exception("committed %s, but making the tracker durable failed", name)
    if megatron_tracker:
        try:
            write_megatron_tracker(rootd, step, opener, fsync)
        except OSError as exc:  # a convenience for Megatron-LM; ckptd's own tracker is written
            log.warning("committed %s, but %s could not be updated: %s", name, MEGATRON_TRACKER, exc)
    if replaced:
        try:
            rootd.remove_tree(doomed)
        except OSError as exc:
            log.warning("could not remove %s (`ckptd gc` removes it later): %s", rootd.path / doomed, exc)
    return None


def committed_once_advice(cat: RootCatalog, step: int, went_back: WentBack | None) -> str:
    """What to do about a save of ``step`` that a committed one refuses."""
    between = cat.left_between(step, went_back)
    if between and went_back is not None:
        shown = ", ".join(between[:5]) + (f" and {len(between) - 5} more" if len(between) > 5 else "")
        return (
            f"the job loaded step {went_back.step} (it went back), but {shown} of the branch it left lie "
            f"between: save those steps first (each replaces its commit), or remove them, then save {step}"
        )
    return "a step is committed once. Save under a new step, or delete the old checkpoint first."


def damaged_commit(cat: RootCatalog, name: str, path: Path) -> tuple[CheckpointEntry | None, str | None]:
    """The committed ``name`` a save of its step may replace because it is damaged (a resume fell
    back past it, and the job saves that step again: refused, the job could never get past it),
    with the damage; ``(None, None)`` when it is not. Only a commit of ckptd's (its commit record
    is there): a checkpoint another tool wrote, which ckptd may merely be unable to read, is never
    replaced. The structural check (a data file lost or cut short, metadata or markers gone: a few
    file reads whatever its size); bit rot in intact files is not looked for here (it would take
    reading all of it): the rank refuses such a save itself, saying to move it away. A file the
    check cannot read raises StorageError (ckptd.recovery.structural_problem): the save fails, and
    a commit that may be intact is never replaced on a guess."""
    existing = next(
        (e for e in cat.entries if e.name == name and e.state in (EntryState.COMMITTED, EntryState.INCOMPLETE)), None
    )
    if existing is None or read_commit_record(path) is None:
        return None, None
    if existing.state is EntryState.INCOMPLETE:
        return existing, f"its checkpoint markers ({METADATA_JSON}, {DCP_METADATA}) are gone"
    damage = structural_problem(path, damage_only=True)
    return (existing, damage) if damage is not None else (None, None)


def rollback_warnings(
    cat: RootCatalog,
    step: int,
    name: str,
    replaced: bool,
    damage: str | None = None,
    went_back: WentBack | None = None,
    parent: CheckpointEntry | None = None,
    left: Sequence[CheckpointEntry] = (),
) -> tuple[str, ...]:
    """What to tell the ranks when the job went back: ``step`` is older than the step committed
    before it (the tracker's; without one, any committed step), or the commit descends from
    ``parent``, not from the tracker's, and so leaves ``left`` on the branch the job left
    (:meth:`RootCatalog.left_by_commit`). Said once, at the rollback: the saves that follow it on
    the new branch leave nothing more. And when the commit replaced a checkpoint of a branch an
    earlier rollback abandoned, or (``damage``) one found damaged."""
    out: list[str] = []
    newer = sorted(e.step for e in cat.committed if e.step > step)
    previous = cat.latest()
    if newer and (previous is None or previous.step > step):
        shown = ", ".join(map(str, newer[:5])) + (f" and {len(newer) - 5} more" if len(newer) > 5 else "")
        out.append(
            f"step {step} is older than committed steps ({shown}): the job went back to an earlier "
            f"step (a rollback). '{TRACKER_FILE}' now names {name}, which a restart resumes from; the "
            "newer checkpoints count as older commits for retention (keep_last keeps the last commits: "
            "a small keep_last retires them at once), and a save of one of their steps replaces it"
        )
    elif left and parent is not None:
        names = sorted(e.name for e in left)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        out.append(
            f"{name} continues from {parent.name}, which the job loaded (it went back: a rollback), so "
            f"{shown} {'is' if len(names) == 1 else 'are'} on the branch it left: retention keeps the last "
            "commits of this branch before "
            "them, and a resume past a damaged latest falls back to one of them only when no checkpoint "
            "of this branch is loadable"
        )
    if damage is not None:
        out.append(f"{name} was damaged ({damage}); this save replaced it")
    elif replaced and cat.abandoned(step) is None and went_back is not None:
        out.append(f"{name}, committed before the job loaded step {went_back.step}, was replaced by this save")
    elif replaced:
        out.append(f"{name} of a branch abandoned by an earlier rollback was replaced by this save")
    return tuple(out)


def write_megatron_tracker(rootd: Dir, step: int, opener: Opener, fsync: bool) -> bool:
    """Point Megatron-LM's ``latest_checkpointed_iteration.txt`` at ``step``; returns whether it did.

    Never for step 0: Megatron-LM's ``read_metadata`` (megatron/training/checkpointing.py)
    asserts ``iteration > 0 or release`` (only its newest versions accept 0), so a tracker
    holding ``0`` stops a Megatron-LM resume from the root. The tracker is left as it was instead
    (absent, or naming the previous step): Megatron-LM starts from scratch or from that step.
    """
    if step <= 0:
        log.info("committed step %d; %s left as it was: Megatron-LM refuses iteration %d", step, MEGATRON_TRACKER, step)
        return False
    atomic_write_bytes(rootd.entry(MEGATRON_TRACKER), megatron_tracker_bytes(step), opener, fsync)
    return True


def check_data_files(tmpd: Dir, data_files: Mapping[str, tuple[int, int]]) -> None:
    """Raise CorruptCheckpointError unless each data file in ``tmpd`` is a regular file (not a
    link) of exactly the size its writer reported: the last check before a commit's rename."""
    for name, (rank, nbytes) in sorted(data_files.items(), key=lambda kv: kv[1][0]):
        st = tmpd.lstat(name)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == nbytes:
            continue
        path = tmpd.path / name  # for the message only (a Path per file costs 8 us: 33 ms at 4,096 ranks)
        if st is None:
            raise CorruptCheckpointError(
                f"rank {rank}'s data file {path} is missing, though its node "
                "reported it written; the step is not committed. If each node has its own disk "
                "under this path, the coordinator's node never sees other nodes' files: a "
                "multi-node job needs a root every node writes into (a shared filesystem), an "
                "s3:// root, or CKPTD_NODE_LOCAL=1 with a mirror (README: The shared filesystem)"
            )
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(
                f"rank {rank}'s data file {path} is not a regular file; the step is not committed"
            )
        if st.st_size != nbytes:
            raise CorruptCheckpointError(
                f"rank {rank}'s data file {path} has {st.st_size} bytes, its "
                f"writer reported {nbytes}; the step is not committed"
            )


def finish_interrupted_commit(root: Path, *, fsync: bool, megatron_tracker: bool) -> str | None:
    """Coordinator start: point the tracker at a checkpoint whose commit a crash interrupted.

    A coordinator that dies between step 2 (the rename) and step 3 (the tracker) of
    :func:`commit_step` leaves a complete, durable checkpoint committed after the one the tracker
    names. Its successor finishes that commit (the rename is the point of no return), so the job
    resumes from it and its step number is not left blocked. Only when the tracker is absent or
    names a sound checkpoint committed before it (commit order, not step order: a rollback commits
    lower steps after higher ones); the candidate must be a real directory (not a link) and pass
    the structural check. Returns the name now tracked. A candidate the check cannot read raises
    StorageError (the daemon does not start): passed over, the job would resume the step before it,
    and its next commit would leave the candidate on an abandoned branch for retention. One whose
    ``.metadata`` names a class ckptd does not know (another writer's, a newer version's) is not
    known to be damaged either: the trackers are left as they are (the job's resume raises
    UnknownClassError, naming it), and the daemon starts.
    """
    cat = scan_root(root, usage=False)
    if cat.tracker_exists and (cat.tracker_problem is not None or cat.latest() is None):
        return None  # an unreadable tracker, or one naming no checkpoint: resolve_latest falls back
    current = cat.latest()
    if current is not None and current.record_problem is not None:
        # Its place in commit order is unknown, so no checkpoint is known to be committed after
        # it: taking its seq for 0 moved the tracker back to an older step, whose next commit
        # then left the tracked one on an "abandoned branch" for retention to remove.
        return None
    try:
        written_s: float | None = os.lstat(root / TRACKER_FILE).st_mtime
    except OSError:
        written_s = None
    if (set_back := tracker_set_back(cat, written_s)) is not None:
        log.warning("%s: %s", root, set_back)
        return None
    for entry in cat.newest_first:
        if current is not None and entry.commit_order <= current.commit_order:
            return None
        if entry.step < 0 or entry.record_problem is not None:
            continue
        try:
            problem = structural_problem(entry.path)
        except UnknownClassError as exc:
            log.warning(
                "%s: %s may be the last commit, but cannot be judged; the trackers are left as they are: %s",
                root,
                entry.name,
                exc,
            )
            return None
        if problem is not None:
            continue
        with Dir.open(root) as rootd:
            atomic_write_bytes(rootd.entry(TRACKER_FILE), tracker_bytes(entry.name), default_opener, fsync)
            if megatron_tracker:
                write_megatron_tracker(rootd, entry.step, default_opener, fsync)
        return entry.name
    return None


def _undo_rename(rootd: Dir, name: str, tmp_name: str, fsync: bool) -> bool:
    """Take a checkpoint whose tracker update failed back to its tmp name: it is not committed
    until ``latest`` can name it, and its ranks are told it aborted (the caller re-raises).
    False when it stays in place (the rename back failed)."""
    try:
        rootd.rename(name, tmp_name)
    except OSError as exc:
        log.error("the tracker update of %s failed, and renaming it back failed too (%s)", rootd.path / name, exc)
        return False
    if fsync:
        try:
            rootd.fsync()
        except OSError as exc:  # a crash before the root is durable may find it in place: a restart names it latest
            log.error("renamed %s back to %s, but the root's fsync failed (%s)", rootd.path / name, tmp_name, exc)
    return True


def remove_partial_files(tmpd: Dir) -> None:
    """Drop ``*.part`` files of writers killed mid-write (by an earlier attempt of this step): every
    data file this commit needs is complete under its final name, and the rest is junk."""
    for name in tmpd.listdir():
        if is_part_file(name) and tmpd.unlink(name):
            log.info("removed %s, left by an interrupted write", tmpd.path / name)


def apply_retention(root: Path, keep_last: int) -> None:
    """Keep the ``keep_last`` last committed checkpoints (step 4 of :func:`commit_step`); failures
    are logged."""
    try:
        plan = plan_gc(scan_root(root, usage=False), keep_last, grace_s=math.inf)
        if plan.refused:
            log.warning("retention skipped: %s", plan.refused)
            return
        plan.remove = [r for r in plan.remove if r.entry.state is not EntryState.PARTIAL]
        for removal, err in apply_gc(plan):
            if err is not None:
                log.warning("retention could not remove %s: %s", removal.entry.path, err)
    except (OSError, CkptdError) as exc:
        log.warning("retention in %s failed: %s", root, exc)
    except Exception:  # the commit is made (latest names it): retention failing must not undo that
        log.exception("retention in %s failed", root)


def remove_tmp(root: Path, step: int, attempt: str) -> None:
    """Remove an aborted attempt's tmp dir (retried: a late writer may still be adding a file). A
    link in its place is removed itself, never followed."""
    name = tmp_dir_name(step, attempt)
    for _ in range(3):
        try:
            with Dir.open(root) as rootd:
                rootd.remove_tree(name)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.debug("removing %s: %s (retrying)", root / name, exc)
            continue
        return
    log.warning("could not remove the aborted save %s; `ckptd gc` removes it later", root / name)


def remove_all_tmp(root: Path) -> list[str]:
    """Remove every attempt's directory (``iter_<step>.<attempt>.tmp``) of ``root`` (coordinator
    start: nothing can be in flight); links with such names are left alone (and never followed)."""
    removed: list[str] = []
    try:
        rootd = Dir.open(root)
    except FileNotFoundError:
        return removed
    with rootd:
        for n in rootd.listdir():
            if (parsed := parse_step_dir(n)) is not None and parsed.partial and rootd.is_real_dir(n):
                try:
                    rootd.remove_tree(n)
                except OSError as exc:
                    log.warning("could not remove %s: %s", root / n, exc)
                    continue
                removed.append(n)
    return removed


def tmp_attempts(root: Path) -> list[tuple[int, str]]:
    """``(step, attempt)`` of every ``iter_<step>.<attempt>.tmp`` directory (not a link) in ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    parsed = ((n, parse_step_dir(n)) for n in names)
    return sorted(
        (p.step, p.attempt)
        for n, p in parsed
        if p is not None and p.partial and p.attempt is not None and is_real_dir(root / n)
    )
