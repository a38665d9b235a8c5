"""The coordinator's commit of one step, and the tracker files of a checkpoint root.

Order of :func:`commit_step` (runs on the coordinator's commit thread, one step at a time):

Each attempt of a step is written into its own ``<step>.<attempt>.tmp`` directory (attempt ids:
ckptd.control.attempt), so files of two attempts never meet in one directory.

1. ``finalize``: validate global coverage of all ranks' records (errors name key and ranks),
   write ``common.pt``, ``.metadata`` and ``metadata.json`` in ``<step>.<attempt>.tmp/`` (each
   tmp + fsync + rename, directory fsynced);
2. check that every rank's data file is there, a regular file of exactly the size its writer
   reported (at least what its records address), then rename ``<step>.<attempt>.tmp`` ->
   ``<step>`` and fsync the root (after removing ``*.part`` files of writers killed mid-write).
   A message can therefore never commit a checkpoint that does not load. For a crash the rename
   is the point of no return:
   should the coordinator die now, its successor finishes the commit at its start
   (:func:`finish_interrupted_commit`); a coordinator that lives undoes it if step 3 fails;
3. replace the ``latest`` tracker atomically (only forward: a step older than the tracker's
   leaves it alone), then Megatron-LM's ``latest_checkpointed_iteration.txt`` likewise, except
   for step 0, which Megatron-LM refuses (see :func:`write_megatron_tracker`; its failure is only
   logged). If ``latest`` cannot be written (disk full...), the directory is renamed back to
   ``<step>.<attempt>.tmp`` and the commit fails: a step counts as committed once the
   tracker can name it, and its ranks must never be told otherwise;
4. retention: keep the newest ``keep_last`` committed checkpoints (and always the tracker's),
   removing older ones via ``*.deleting`` (:mod:`ckptd.retention`).

A failure before step 2 leaves no committed directory: the caller aborts and removes the tmp dir.
Failures in step 4 are logged, never turned into an abort (the checkpoint is already committed).
"""

from __future__ import annotations

import logging
import math
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from ..catalog import EntryState, is_checkpoint_dir, read_tracker, scan_root
from ..errors import CheckpointExistsError, CkptdError, CorruptCheckpointError
from ..format.durable import Opener, atomic_write_bytes, default_opener
from ..format.finalize import finalize
from ..format.records import ItemRecord
from ..format.rootlayout import (
    MEGATRON_TRACKER,
    TRACKER_FILE,
    committed_step,
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

log = logging.getLogger(__name__)


def tracker_step(root: Path) -> int | None:
    """The step the ``latest`` tracker names, or None (no tracker, or not a step's name)."""
    _, name, _ = read_tracker(root)
    return committed_step(name or "")


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
) -> str:
    """Commit ``<root>/<step>.<attempt>.tmp`` (see the module docstring); returns the committed name.

    ``data_files``: every rank's data file name -> ``(rank, bytes its writer reported)``. Every
    file is written relative to the root's and the step directory's fds, the step directory is
    opened without following a link (a planted link fails the commit with StorageError naming
    it), and trackers replace their entry, never write through a link.
    """
    name = step_dir_name(step)
    tmp = tmp_dir_name(step, attempt)
    final = root / name
    with Dir.open(root) as rootd:
        if rootd.lstat(name) is not None:
            raise CheckpointExistsError(
                f"{final} already exists; a step is committed once. Save under a "
                "new step, or delete the old checkpoint first."
            )
        if rootd.lstat(tmp) is None:
            raise CkptdError(f"{root / tmp} vanished before the commit (removed by gc or by hand?)")
        with rootd.subdir(tmp) as tmpd:
            _remove_partial_files(tmpd)
            finalize(tmpd, records, common, opener, fsync, checkpoint_id=str(final))
            check_data_files(tmpd, data_files)
        rootd.rename(tmp, name)
        try:
            if fsync:
                rootd.fsync()
            current = tracker_step(root)
            if current is not None and not _is_step_checkpoint(root, current):
                # A tracker naming a missing or incomplete checkpoint must not pin `latest` forever.
                log.warning(
                    "the tracker of %s names step %d, which is not a committed checkpoint; replacing it", root, current
                )
                current = None
            if current is None or step >= current:
                atomic_write_bytes(rootd.entry(TRACKER_FILE), tracker_bytes(name), opener, fsync)
        except BaseException:
            if tracker_step(root) != step:
                _undo_rename(rootd, name, tmp, fsync)
                raise
            log.exception("committed %s, but making the tracker durable failed", name)
            current = None
        if current is not None and step < current:
            log.info("committed %s; the tracker stays at the newer step %d", name, current)
        elif megatron_tracker:
            try:
                write_megatron_tracker(rootd, step, opener, fsync)
            except OSError as exc:  # a convenience for Megatron-LM; ckptd's own tracker is written
                log.warning("committed %s, but %s could not be updated: %s", name, MEGATRON_TRACKER, exc)
    if keep_last > 0:
        _apply_retention(root, keep_last)
    return name


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
                "reported it written; the step is not committed"
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


def _is_step_checkpoint(root: Path, step: int) -> bool:
    """``iter_<step>`` is a committed checkpoint directory itself (not a link to one)."""
    path = root / step_dir_name(step)
    return is_real_dir(path) and is_checkpoint_dir(path)


def finish_interrupted_commit(root: Path, *, fsync: bool, megatron_tracker: bool) -> str | None:
    """Coordinator start: point the tracker at a checkpoint whose commit a crash interrupted.

    A coordinator that dies between step 2 (the rename) and step 3 (the tracker) of
    :func:`commit_step` leaves a complete, durable checkpoint newer than the tracker. Its successor
    finishes that commit (the rename is the point of no return), so the job resumes from it and its
    step number is not left blocked. Only when the tracker is absent or names an older, sound
    checkpoint; the candidate must be a real directory (not a link) and pass the structural check.
    Returns the name now tracked.
    """
    current = tracker_step(root)
    if current is None and os.path.lexists(root / TRACKER_FILE):
        return None  # an unreadable tracker: resolve_latest falls back, the next commit replaces it
    if current is not None and not _is_step_checkpoint(root, current):
        return None
    committed = (committed_step(n) for n in os.listdir(root))
    newer = sorted((s for s in committed if s is not None and (current is None or s > current)), reverse=True)
    for step in newer:
        name = step_dir_name(step)
        if not _is_step_checkpoint(root, step) or structural_problem(root / name) is not None:
            continue
        with Dir.open(root) as rootd:
            atomic_write_bytes(rootd.entry(TRACKER_FILE), tracker_bytes(name), default_opener, fsync)
            if megatron_tracker:
                write_megatron_tracker(rootd, step, default_opener, fsync)
        return name
    return None


def _undo_rename(rootd: Dir, name: str, tmp_name: str, fsync: bool) -> None:
    """Take a checkpoint whose tracker update failed back to its tmp name: it is not committed
    until ``latest`` can name it, and its ranks are told it aborted (the caller re-raises)."""
    try:
        rootd.rename(name, tmp_name)
        if fsync:
            rootd.fsync()
    except OSError as exc:
        log.error(
            "the tracker update of %s failed and %s could not be renamed back (%s); it is "
            "complete but not named by the tracker",
            rootd.path / name,
            rootd.path / name,
            exc,
        )


def _remove_partial_files(tmpd: Dir) -> None:
    """Drop ``*.part`` files of writers killed mid-write (by an earlier attempt of this step): every
    data file this commit needs is complete under its final name, and the rest is junk."""
    for name in tmpd.listdir():
        if is_part_file(name) and tmpd.unlink(name):
            log.info("removed %s, left by an interrupted write", tmpd.path / name)


def _apply_retention(root: Path, keep_last: int) -> None:
    try:
        plan = plan_gc(scan_root(root), keep_last, grace_s=math.inf)
        if plan.refused:
            log.warning("retention skipped: %s", plan.refused)
            return
        plan.remove = [r for r in plan.remove if r.entry.state is not EntryState.PARTIAL]
        for removal, err in apply_gc(plan):
            if err is not None:
                log.warning("retention could not remove %s: %s", removal.entry.path, err)
    except (OSError, CkptdError) as exc:
        log.warning("retention in %s failed: %s", root, exc)


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
