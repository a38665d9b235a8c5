"""The coordinator's commit of one step, and the tracker files of a checkpoint root.

Order of :func:`commit_step` (runs on the coordinator's commit thread, one step at a time):

1. ``finalize``: validate global coverage of all ranks' records (errors name key and ranks),
   write ``common.pt``, ``.metadata`` and ``metadata.json`` in ``<step>.tmp/`` (each tmp + fsync +
   rename, directory fsynced);
2. rename ``<step>.tmp`` -> ``<step>`` and fsync the root: the checkpoint is committed;
3. replace the ``latest`` tracker atomically (only forward: a step older than the tracker's
   leaves it alone), then Megatron-LM's ``latest_checkpointed_iteration.txt`` likewise;
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
import shutil
from pathlib import Path

from ..catalog import STEP_PREFIX, TMP_SUFFIX, TRACKER_FILE, read_tracker, scan_root, step_dir_name
from ..errors import CheckpointExistsError, CkptdError
from ..format.durable import atomic_write_bytes, default_opener, fsync_dir, Opener
from ..format.finalize import finalize
from ..format.records import ItemRecord
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
    """Commit ``<root>/<step>.tmp`` (see the module docstring); returns the committed name."""
    name = step_dir_name(step)
    tmp, final = tmp_dir(root, step), root / name
    if final.exists():
        raise CheckpointExistsError(f"{final} already exists; a step is committed once. Save under a "
                                    "new step, or delete the old checkpoint first.")
    if not tmp.is_dir():
        raise CkptdError(f"{tmp} vanished before the commit (removed by gc or by hand?)")
    finalize(tmp, records, common, opener, fsync, checkpoint_id=str(final))
    os.rename(tmp, final)
    if fsync:
        fsync_dir(root)
    current = tracker_step(root)
    if current is None or step >= current:
        atomic_write_bytes(root / TRACKER_FILE, (name + "\n").encode(), opener, fsync)
        if megatron_tracker:
            atomic_write_bytes(root / MEGATRON_TRACKER, f"{step}\n".encode(), opener, fsync)
    else:
        log.info("committed %s; the tracker stays at the newer step %d", name, current)
    if keep_last > 0:
        _apply_retention(root, keep_last)
    return name


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
    """Remove an aborted step's tmp dir (retried: a late writer may still be adding a file)."""
    path = tmp_dir(root, step)
    for _ in range(3):
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.debug("removing %s: %s (retrying)", path, exc)
            continue
        return
    log.warning("could not remove the aborted save %s; `ckptd gc` removes it later", path)


def remove_all_tmp(root: Path) -> list[str]:
    """Remove every ``iter_*.tmp`` of ``root`` (coordinator start: nothing can be in flight)."""
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    for n in names:
        if n.startswith(STEP_PREFIX) and n.endswith(TMP_SUFFIX) and (root / n).is_dir():
            shutil.rmtree(root / n, ignore_errors=True)
            removed.append(n)
    return removed


def tmp_steps(root: Path) -> list[int]:
    """Steps that have an ``iter_*.tmp`` directory in ``root``."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    pattern = re.compile(rf"^{STEP_PREFIX}(\d+){re.escape(TMP_SUFFIX)}$")
    return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)) and (root / n).is_dir())
