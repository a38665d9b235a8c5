"""The coordinator's commit of one step, and the tracker files of a checkpoint root.

Order of :func:`commit_step` (runs on the coordinator's commit thread, one step at a time):

1. ``finalize``: validate global coverage of all ranks' records (errors name key and ranks),
   write ``common.pt``, ``.metadata`` and ``metadata.json`` in ``<step>.tmp/`` (each tmp + fsync +
   rename, directory fsynced);
2. rename ``<step>.tmp`` -> ``<step>`` and fsync the root (after removing ``*.part`` files of
   writers killed by an earlier attempt of the step). For a crash this is the point of no return:
   should the coordinator die now, its successor finishes the commit at its start
   (:func:`finish_interrupted_commit`); a coordinator that lives undoes it if step 3 fails;
3. replace the ``latest`` tracker atomically (only forward: a step older than the tracker's
   leaves it alone), then Megatron-LM's ``latest_checkpointed_iteration.txt`` likewise (its
   failure is only logged). If ``latest`` cannot be written (disk full...), the directory is
   renamed back to ``<step>.tmp`` and the commit fails: a step counts as committed once the
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
import re
from pathlib import Path

from ..catalog import (
    PART_SUFFIX,
    STEP_PREFIX,
    TMP_SUFFIX,
    TRACKER_FILE,
    is_checkpoint_dir,
    read_tracker,
    scan_root,
    step_dir_name,
)
from ..errors import CheckpointExistsError, CkptdError
from ..format.durable import atomic_write_bytes, default_opener, Opener
from ..format.finalize import finalize
from ..format.safefs import Dir, is_real_dir
from ..format.records import ItemRecord
from ..recovery import structural_problem
from ..retention import apply_gc, plan_gc

log = logging.getLogger(__name__)

MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
_STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def tmp_dir(root: Path, step: int) -> Path:
    return root / (step_dir_name(step) + TMP_SUFFIX)


def tracker_step(root: Path) -> int | None:
    """The step the ``latest`` tracker names, or None (no tracker, or not an ``iter_`` name)."""
    _, name, _ = read_tracker(root)
    m = _STEP_NAME.match(name or "")
    return int(m.group(1)) if m else None


def commit_step(root: Path, step: int, records: list[ItemRecord], common: bytes, *, fsync: bool,
                keep_last: int, megatron_tracker: bool, opener: Opener = default_opener) -> str:
    """Commit ``<root>/<step>.tmp`` (see the module docstring); returns the committed name.

    Every file is written relative to the root's and the step directory's fds, the step directory
    is opened without following a link (a planted ``iter_N.tmp`` link fails the commit with
    StorageError naming it), and trackers replace their entry, never write through a link.
    """
    name = step_dir_name(step)
    tmp_name = name + TMP_SUFFIX
    final, tmp = root / name, root / tmp_name
    with Dir.open(root) as rootd:
        if rootd.lstat(name) is not None:
            raise CheckpointExistsError(f"{final} already exists; a step is committed once. Save under a "
                                        "new step, or delete the old checkpoint first.")
        if rootd.lstat(tmp_name) is None:
            raise CkptdError(f"{tmp} vanished before the commit (removed by gc or by hand?)")
        with rootd.subdir(tmp_name) as tmpd:
            _remove_partial_files(tmpd)
            finalize(tmpd, records, common, opener, fsync, checkpoint_id=str(final))
        rootd.rename(tmp_name, name)
        try:
            if fsync:
                rootd.fsync()
            current = tracker_step(root)
            if current is not None and not _is_step_checkpoint(root, current):
                # A tracker naming a missing or incomplete checkpoint must not pin `latest` forever.
                log.warning("the tracker of %s names step %d, which is not a committed checkpoint; "
                            "replacing it", root, current)
                current = None
            if current is None or step >= current:
                atomic_write_bytes(rootd.entry(TRACKER_FILE), (name + "\n").encode(), opener, fsync)
        except BaseException:
            if tracker_step(root) != step:
                _undo_rename(rootd, name, tmp_name, fsync)
                raise
            log.exception("committed %s, but making the tracker durable failed", name)
            current = None
        if current is not None and step < current:
            log.info("committed %s; the tracker stays at the newer step %d", name, current)
        elif megatron_tracker:
            try:
                atomic_write_bytes(rootd.entry(MEGATRON_TRACKER), f"{step}\n".encode(), opener, fsync)
            except OSError as exc:  # a convenience for Megatron-LM; ckptd's own tracker is written
                log.warning("committed %s, but %s could not be updated: %s", name, MEGATRON_TRACKER, exc)
    if keep_last > 0:
        _apply_retention(root, keep_last)
    return name


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
    newer = sorted((int(m.group(1)) for n in os.listdir(root) if (m := _STEP_NAME.match(n))
                    and (current is None or int(m.group(1)) > current)), reverse=True)
    for step in newer:
        name = step_dir_name(step)
        if not _is_step_checkpoint(root, step) or structural_problem(root / name) is not None:
            continue
        atomic_write_bytes(root / TRACKER_FILE, (name + "\n").encode(), default_opener, fsync)
        if megatron_tracker:
            atomic_write_bytes(root / MEGATRON_TRACKER, f"{step}\n".encode(), default_opener, fsync)
        return name
    return None


def _undo_rename(rootd: Dir, name: str, tmp_name: str, fsync: bool) -> None:
    """Take a checkpoint whose tracker update failed back to ``<step>.tmp``: it is not committed
    until ``latest`` can name it, and its ranks are told it aborted (the caller re-raises)."""
    try:
        rootd.rename(name, tmp_name)
        if fsync:
            rootd.fsync()
    except OSError as exc:
        log.error("the tracker update of %s failed and %s could not be renamed back (%s); it is "
                  "complete but not named by the tracker", rootd.path / name, rootd.path / name, exc)


def _remove_partial_files(tmpd: Dir) -> None:
    """Drop ``*.part`` files of writers killed mid-write (by an earlier attempt of this step): every
    data file this commit needs is complete under its final name, and the rest is junk."""
    for name in tmpd.listdir():
        if name.endswith(PART_SUFFIX) and tmpd.unlink(name):
            log.info("removed %s, left by an interrupted write", tmpd.path / name)


def _apply_retention(root: Path, keep_last: int) -> None:
    try:
        plan = plan_gc(scan_root(root), keep_last, grace_s=math.inf)
        if plan.refused:
            log.warning("retention skipped: %s", plan.refused)
            return
        plan.remove = [r for r in plan.remove if not r.entry.name.endswith(TMP_SUFFIX)]
        for removal, err in apply_gc(plan):
            if err is not None:
                log.warning("retention could not remove %s: %s", removal.entry.path, err)
    except (OSError, CkptdError) as exc:
        log.warning("retention in %s failed: %s", root, exc)


def remove_tmp(root: Path, step: int) -> None:
    """Remove an aborted step's tmp dir (retried: a late writer may still be adding a file). A
    link in its place is removed itself, never followed."""
    name = step_dir_name(step) + TMP_SUFFIX
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
    """Remove every ``iter_*.tmp`` directory of ``root`` (coordinator start: nothing can be in
    flight); links with such names are left alone (and never followed)."""
    removed = []
    try:
        rootd = Dir.open(root)
    except FileNotFoundError:
        return removed
    with rootd:
        for n in rootd.listdir():
            if n.startswith(STEP_PREFIX) and n.endswith(TMP_SUFFIX) and rootd.is_real_dir(n):
                try:
                    rootd.remove_tree(n)
                except OSError as exc:
                    log.warning("could not remove %s: %s", root / n, exc)
                    continue
                removed.append(n)
    return removed


def tmp_steps(root: Path) -> list[int]:
    """Steps that have an ``iter_*.tmp`` directory (not a link) in ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    pattern = re.compile(rf"^{STEP_PREFIX}(\d+){re.escape(TMP_SUFFIX)}$")
    return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)) and is_real_dir(root / n))
