"""Garbage collection of a checkpoint root: old committed checkpoints and abandoned saves.

Order of one collection (any process may run it; it needs no daemon):

1. :func:`plan_gc` (pure): from a :class:`~ckptd.catalog.RootCatalog`, keep the ``keep`` last
   committed checkpoints (in commit order, :mod:`ckptd.format.commitrecord`: after a rollback the
   steps saved since are the newest, whatever their numbers; and those of the branch the job
   trains on before those of branches a rollback abandoned, so the step it rolled back to outlasts
   the steps it rolled back from) and always the one the tracker names; remove older committed ones,
   ``*.tmp`` directories whose last write is older than ``grace_s`` (a save in flight keeps
   writing, so it stays younger than the grace period) and, on a node's disk of a node-local
   root, older than the node's last commit (a node that could not finish a committed step keeps
   its files in the ``.tmp``: ckptd.roots.nodelocal; and not at or above the lowest step this disk
   keeps a commit of, for the same reason), and ``*.deleting`` leftovers. With ``keep=None``
   (``ckptd gc`` without ``--keep``) no committed checkpoint is removed: only the leftovers are.
2. :func:`apply_gc`: each removal first renames the directory to ``<name>.deleting`` (and fsyncs
   the root), then deletes it. A crash midway therefore never leaves a half-deleted directory
   under a committed name, and a save still writing into a ``.tmp`` that is collected by mistake
   fails its commit rename instead of committing a partial checkpoint. A checkpoint a load holds
   a lease on (:mod:`ckptd.format.lease`) is skipped and stays in ``plan.kept``: the next
   collection removes it.

The tracker is never modified. When it cannot be trusted (unreadable, or naming a missing or
incomplete checkpoint) nothing committed is removed: what a restart would load is unknown.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .catalog import CheckpointEntry, EntryState, RootCatalog, read_tracker, scan_root
from .errors import CkptdError
from .format.commitrecord import read_commit_record
from .format.lease import try_exclusive
from .format.rootlayout import TRACKER_FILE, deleting_name
from .format.safefs import Dir

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True)
class Removal:
    entry: CheckpointEntry
    reason: str


@dataclass
class GcPlan:
    root: Path
    remove: list[Removal] = field(default_factory=list)
    kept: list[tuple[CheckpointEntry, str]] = field(default_factory=list)  # (entry, why kept)
    refused: str | None = None  # why committed checkpoints are not collected at all
    keep: int | None = 1  # None: no committed checkpoint is collected
    grace_s: float = DEFAULT_GRACE_S
    tracker_name: str | None = None  # what the tracker named when the plan was made
    # Once the tracker moved during the collection: the committed removals a fresh plan makes
    # too, by (name, commit seq). None while the scan's plan stands.
    confirmed: set[tuple[str, int]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(r.entry.usage.nbytes for r in self.remove)

    def stale(self, removal: Removal, tracker_now: str | None, rescan: Callable[[], RootCatalog]) -> str | None:
        """Why ``removal`` is no longer this collection's to make, or None. The tracker moving
        since the scan may be a rollback (the job loaded an older step and committed after it):
        what the last ``keep`` commits are changed, and the scan's plan would remove the step
        rolled back to while keeping those rolled back from. Then the root is scanned and planned
        again (once per move), and only a removal the fresh plan makes too goes ahead."""
        if removal.entry.state is not EntryState.COMMITTED:
            return None
        if tracker_now != self.tracker_name:
            fresh = plan_gc(rescan(), self.keep, self.grace_s)
            self.confirmed = {(r.entry.name, r.entry.commit_seq) for r in fresh.remove}
            self.tracker_name = tracker_now
        if self.confirmed is None or (removal.entry.name, removal.entry.commit_seq) in self.confirmed:
            return None
        return f"the tracker moved since the scan (now {tracker_now}), and a fresh plan keeps it"


def plan_gc(
    cat: RootCatalog,
    keep: int | None,
    grace_s: float = DEFAULT_GRACE_S,
    now: float | None = None,
    intact: Callable[[CheckpointEntry], bool] | None = None,
) -> GcPlan:
    """Decide what a collection removes (see the module docstring); touches nothing.

    ``keep=None``: every committed checkpoint is kept, only abandoned saves and interrupted
    removals are collected (and a tracker that cannot be trusted refuses nothing: no commit is
    at stake).

    ``intact`` (``ckptd gc``): whether a committed checkpoint is loadable; the newest one that is
    (branch first) is kept whatever ``keep`` says, so a damaged latest never leaves the root with
    no loadable checkpoint. Asked newest first, until one is."""
    if keep is not None and keep < 1:
        raise CkptdError(f"gc: keep must be >= 1 (or None to keep every committed checkpoint), got {keep}")
    if grace_s < 0:
        raise CkptdError(f"gc: grace_s must be >= 0, got {grace_s}")
    now = time.time() if now is None else now
    plan = GcPlan(cat.root, keep=keep, grace_s=grace_s, tracker_name=cat.latest_name)
    if keep is None:
        pass  # no committed checkpoint is removed, so there is nothing to refuse
    elif cat.tracker_problem is not None:
        plan.refused = f"{cat.tracker_problem}; committed checkpoints are left alone until the tracker is fixed"
    elif (
        not cat.tracker_exists
        and cat.megatron_latest_name is None
        and not cat.node_local
        and (newest := next((e for e in cat.newest_first if e.commit_seq), None)) is not None
    ):
        # ckptd committed here, and every commit names its step in the tracker: without one (a
        # crash between a commit and its tracker, or it was removed) the branch the job trains on
        # is unknown, and commit order alone would keep an abandoned branch over it.
        plan.refused = (
            f"{cat.root} has checkpoints committed by ckptd but no '{TRACKER_FILE}' tracker; committed "
            "checkpoints are left alone until the next commit or daemon start names the latest, or until "
            f"you write the name of the checkpoint to resume from into {TRACKER_FILE} (the newest commit is "
            f"{newest.name})"
        )
    off_branch = {e.name for e in cat.off_branch()}
    # A checkpoint whose commit record cannot be read has no known place in commit order: it is
    # neither counted among the last ones nor retired (it would sort as the oldest commit).
    order = [e for e in cat.branch_first if e.record_problem is None or e.is_latest]
    for e in cat.branch_first:
        if e.record_problem is not None and not e.is_latest:
            plan.kept.append((e, f"{e.record_problem}: its place in commit order is unknown; remove it by hand"))
    for rank, e in enumerate(order):
        if e.is_latest:
            plan.kept.append((e, "named by the tracker"))
        elif e.name == cat.megatron_latest_name:
            plan.kept.append((e, "named by Megatron-LM's tracker (latest_checkpointed_iteration.txt)"))
        elif keep is None:
            plan.kept.append((e, "committed (no retention count given: only abandoned saves are collected)"))
        elif rank < keep:
            plan.kept.append((e, f"among the {keep} last committed"))
        elif e.name == cat.mirrored_name:
            plan.kept.append((e, "the mirror's latest checkpoint copies it; kept until a newer step is mirrored"))
        elif plan.refused is not None:
            plan.kept.append((e, "the tracker is missing or cannot be trusted"))
        else:
            where = "on a branch a rollback abandoned, " if e.name in off_branch else ""
            plan.remove.append(Removal(e, f"{where}committed before the {keep} last committed"))
    if intact is not None and plan.remove:
        doomed = {id(r.entry): r for r in plan.remove}
        for damaged, e in enumerate(order):
            if intact(e):
                if id(e) in doomed:
                    plan.remove.remove(doomed[id(e)])
                    plan.kept.append((e, f"the newest loadable checkpoint ({damaged} newer ones kept are damaged)"))
                break
    newest_commit_s = max((e.committed_unix_s for e in cat.committed), default=0.0)
    # Node-local: the lowest step this disk keeps a commit of. A .tmp at or above it may hold this
    # node's files of a step committed on node 0 that it could not finish (ckptd.roots.nodelocal):
    # a load of that retained step reads them there.
    # (The keep-N commits and the tracker's: not one kept for another reason, a stalled mirror's.)
    window = [e for rank, e in enumerate(order) if keep is None or rank < keep or e.is_latest]
    window_low = min((e.step for e in window), default=None)
    for e in cat.entries:
        if e.state is EntryState.PARTIAL:
            age_s = now - e.usage.newest_mtime
            if e.is_latest or e.name == cat.megatron_latest_name:
                plan.kept.append((e, "named by a tracker, though it holds no commit: inspect it by hand"))
            elif e.record_problem is not None:  # an object store's checkpoint of another tool
                plan.kept.append((e, e.record_problem))
            elif cat.node_local and window_low is not None and e.step >= window_low:
                plan.kept.append(
                    (
                        e,
                        "node-local root: within the steps this disk keeps commits of, it may hold this "
                        "node's files of a retained step committed on node 0 (a load of that step reads "
                        "them here); collected once retention leaves its step behind",
                    )
                )
            elif cat.node_local and e.usage.newest_mtime >= newest_commit_s:
                # A node that got COMMITTED but could not finish the step on its disk keeps its files
                # here, and the mirror copy and a resume read them here: the latest step may be one.
                plan.kept.append(
                    (
                        e,
                        "node-local root: written after this node's last commit, it may hold this node's "
                        "files of a step committed on node 0 (the mirror copy and a resume read them here); "
                        "collected once a newer step commits on this node",
                    )
                )
            elif age_s >= grace_s:
                plan.remove.append(
                    Removal(e, f"abandoned save, last written {age_s:.0f} s ago (grace {grace_s:.0f} s)")
                )
            else:
                plan.kept.append((e, f"save may be in flight: last written {age_s:.0f} s ago, grace {grace_s:.0f} s"))
        elif e.state is EntryState.DELETING:
            plan.remove.append(Removal(e, "left over by an interrupted gc"))
        elif e.state is EntryState.INCOMPLETE:
            plan.kept.append((e, "committed name without metadata.json: inspect it by hand"))
    plan.remove.sort(key=lambda r: (r.entry.step, r.entry.name))
    return plan


class CheckpointInUse(CkptdError):
    """A load holds a lease on the checkpoint a collection was about to remove."""


class CheckpointChanged(CkptdError):
    """The checkpoint a removal was planned for is no longer the one under its name (``ckptd gc``
    scanned the root, then the job committed the step again after a rollback, or named it latest)."""


@contextmanager
def _removal_lock(rootd: Dir, name: str) -> Iterator[int | None]:
    """Hold the exclusive lock of ``rootd/name`` while it is removed (see :mod:`ckptd.format.lease`);
    raises CheckpointInUse when a load holds its lease. A link is not opened (it is removed itself):
    None then, else the locked directory's fd."""
    if not rootd.is_real_dir(name):
        yield None
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=rootd.fd)
    try:
        if not try_exclusive(fd, rootd.path / name):
            raise CheckpointInUse(f"{rootd.path / name} is being loaded (a load holds its lease)")
        yield fd
    finally:
        os.close(fd)


def _check_unchanged(rootd: Dir, fd: int | None, entry: CheckpointEntry) -> None:
    """Raise CheckpointChanged when ``entry``'s name no longer holds what the scan found: a
    committed step whose commit record has another sequence number now (committed again after a
    rollback replaced it), or one the tracker names now. Checked under the removal lock, and the
    name checked to be the locked directory right before the rename (a commit that replaces the
    step in the microseconds between is the one race left)."""
    name = entry.path.name
    if fd is None or entry.state is EntryState.PARTIAL or entry.state is EntryState.DELETING:
        return  # an attempt's directory: its name is never another save's
    if read_tracker(rootd.path)[1] == name:
        raise CheckpointChanged(f"{rootd.path / name} is named latest now")
    record = read_commit_record(rootd.path / name)
    if entry.state is EntryState.COMMITTED and (record.seq if record is not None else 0) != entry.commit_seq:
        if record is None and entry.commit_seq:  # unreadable now (damage, an I/O error), or gone
            raise CheckpointChanged(f"{rootd.path / name}: its commit record cannot be read any more")
        raise CheckpointChanged(f"{rootd.path / name} was committed again since the scan")
    st, locked = rootd.lstat(name), os.fstat(fd)
    if st is None or (st.st_dev, st.st_ino) != (locked.st_dev, locked.st_ino):
        raise CheckpointChanged(f"{rootd.path / name} was replaced since the scan")


def remove_entry(entry: CheckpointEntry) -> None:
    """Rename ``entry`` to ``*.deleting`` (made durable), then delete it; raises CheckpointInUse,
    touching nothing, while a load holds a lease on it, and CheckpointChanged when its name holds
    another checkpoint than the scan found (see :func:`_check_unchanged`).

    Both act on entries of the root's open directory: a link (at either name, or anywhere inside)
    is removed itself, never followed, so a collection never deletes anything outside the root.
    """
    name = entry.path.name
    with Dir.open(entry.path.parent) as rootd, _removal_lock(rootd, name) as fd:
        _check_unchanged(rootd, fd, entry)
        if entry.state is not EntryState.DELETING:
            doomed = deleting_name(name)
            if rootd.lstat(doomed) is not None:
                rootd.remove_tree(doomed)  # an earlier interrupted removal of the same step
            rootd.rename(name, doomed)
            rootd.fsync()
            name = doomed
        rootd.remove_tree(name)


def apply_gc(plan: GcPlan) -> list[tuple[Removal, str | None]]:
    """Carry out ``plan``; returns each removal with None or the error that stopped it.

    One failed removal does not stop the others; the caller reports every failure. A checkpoint
    being loaded is not removed: it moves from ``plan.remove`` to ``plan.kept``.
    """
    done: list[tuple[Removal, str | None]] = []
    for removal in list(plan.remove):
        stale = plan.stale(removal, read_tracker(plan.root)[1], lambda: scan_root(plan.root, usage=False))
        if stale is not None:
            _postpone(plan, removal, f"{stale}; a later collection decides")
            continue
        try:
            remove_entry(removal.entry)
        except CheckpointInUse:
            _postpone(plan, removal, "being loaded (a load holds its lease); removed by a later collection")
        except CheckpointChanged as exc:
            _postpone(plan, removal, f"{exc}; a later collection decides")
        except OSError as exc:
            log.warning("gc: could not remove %s: %s", removal.entry.path, exc)
            done.append((removal, f"{type(exc).__name__}: {exc}"))
        else:
            log.info("gc: removed %s (%s)", removal.entry.path, removal.reason)
            done.append((removal, None))
    return done


def _postpone(plan: GcPlan, removal: Removal, why: str) -> None:
    log.info("gc: kept %s for now: %s", removal.entry.path, why)
    plan.remove.remove(removal)
    plan.kept.append((removal.entry, why))
