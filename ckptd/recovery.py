"""Which checkpoint of a root a job resumes from, even when the ``latest`` tracker is damaged.

:func:`resolve_latest` (used by :meth:`ckptd.Checkpointer.latest` and ``load``) decides, in order:

1. the tracker names a committed checkpoint that passes a structural check (``metadata.json``,
   a decodable ``.metadata``, every data file present and long enough (on ``s3://``: every data
   object the commit recorded listed with its size), ``common.pt`` intact):
   that one, silently (the normal case);
2. otherwise (tracker missing, unreadable, naming a missing, incomplete or damaged directory):
   the last committed ``iter_<step>`` checkpoint (in commit order, :mod:`ckptd.format.commitrecord`:
   after a rollback that is not the highest step) that passes the same check, with a logged
   WARNING saying why the tracker was not followed. Those of the tracker's branch come first: a
   step a rollback abandoned (committed before the tracker's target, at a higher step) is taken
   only when nothing of the tracker's branch is loadable, and the warning says so;
3. no such checkpoint: ``None`` when the root never held a checkpoint (a fresh start), else
   :class:`~ckptd.errors.CorruptCheckpointError`: silently starting from scratch would throw away
   the training a damaged root still records.

``*.tmp`` and ``*.deleting`` directories are never candidates. The structural check reads a few
small files, never the tensor data; ``ckptd verify`` checks every byte against its checksum. A file
the check cannot read (the storage failed: ESTALE, EIO on a network filesystem, EMFILE, EACCES) is
not damage: :class:`~ckptd.errors.StorageError` is raised, and nothing is resumed past it. Nor is a
``.metadata`` naming a class ckptd does not know (a newer torch's or Megatron-Core's):
:class:`~ckptd.errors.UnknownClassError` is raised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .catalog import CheckpointEntry, EntryState, RootCatalog
from .errors import (
    CheckpointNotFoundError,
    CheckpointRemovedError,
    CkptdError,
    CorruptCheckpointError,
    StorageError,
    UnknownClassError,
)
from .format.commitrecord import COMMIT_RECORD
from .format.lease import ReadLease
from .format.rootlayout import TRACKER_FILE
from .s3catalog import scan_any
from .storage.s3client import S3Client
from .storage.s3view import s3_checkpoint_view
from .storage.url import Location, S3Location, parse_location

if TYPE_CHECKING:
    from .verify import VerifyReport

log = logging.getLogger(__name__)

# Scans of a root while retention removes what a scan found (each commit of a job can remove one).
_RESOLVE_TRIES = 3


@dataclass(frozen=True)
class LatestChoice:
    """The checkpoint to resume from, and why the tracker was not followed (None: it was);
    ``skipped``: the newer committed checkpoints the structural check refused, ``(name, problem)``
    (a caller that resumes from another copy of one of them names what was wrong with it)."""

    entry: CheckpointEntry
    fallback_reason: str | None = None
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def step(self) -> int | None:
        return self.entry.step if self.entry.step >= 0 else None


def structural_problem(
    path: Location, *, node_local: bool = False, damage_only: bool = False, allow_unsafe_pickle: bool = False
) -> str | None:
    """Why ``path`` cannot be loaded as a complete checkpoint (first error found), or None. An
    ``s3://`` checkpoint is checked through its local view (its small files, and the data objects
    its commit record names listed with their sizes, one LIST; no data is read). Imports torch and
    DCP's metadata classes (to read ``.metadata``): a node daemon calls it only when it finishes a
    commit a crash interrupted.

    A directory is checked under a load's lease (ckptd.format.lease), so retention does not remove
    it half-way through the check (whose missing files would read as damage); one removed before
    or, where the filesystem cannot lease, during the check raises CheckpointNotFoundError.

    ``node_local``: the directory is on one node's own disk (config ``node_local``), which holds
    only that node's data files; they are not checked (ckptd.storage.nodeview decides per file
    whether it is read there or from the mirror). ``damage_only``: what ckptd cannot load but is
    not damaged (a backend, a DCP extension ckptd does not read) is no problem.

    A file the storage fails to return (a network filesystem's ESTALE or EIO, EMFILE, EACCES: an
    unreadable finding of :func:`ckptd.verify.verify_checkpoint`) raises StorageError naming it,
    unless damage was found as well: nothing is known of its bytes, and taken for damage an intact
    newest checkpoint was resumed past (its steps then left on an abandoned branch for retention
    to remove) or replaced by a save of its step. So does a ``.metadata`` that names a class ckptd
    does not know raise UnknownClassError (``damage_only``: no problem), unless
    ``allow_unsafe_pickle`` (the caller trusts the checkpoint) lets it be unpickled."""
    from .verify import verify_checkpoint

    if isinstance(path, S3Location):
        try:
            with s3_checkpoint_view(path, listed=True) as view:
                checked = verify_checkpoint(view.directory, read_items=False, allow_unsafe_pickle=allow_unsafe_pickle)
                problem = _report_problem(checked, view.directory, path, damage_only)
        except (StorageError, CheckpointRemovedError, UnknownClassError):
            # The store failed to answer, retention removed the checkpoint meanwhile, or it names a
            # class ckptd does not know: none is damage. Taken for damage, an outage resumed from an
            # older step, and the next commit made the newest ones an abandoned branch, which
            # retention then removed.
            raise
        except CkptdError as exc:
            problem = str(exc).rstrip(".")
        # Only committed checkpoints are checked: one whose commit object is gone now was retired
        # (its commit object goes first) while or before the view opened it.
        if problem is not None and S3Client(path).head(COMMIT_RECORD) is None:
            raise CheckpointRemovedError(f"{path} was removed while it was checked (by retention or `ckptd gc`)")
        return problem
    with ReadLease.acquire(path) as lease:
        try:
            report = verify_checkpoint(
                path, read_items=False, data_files=not node_local, allow_unsafe_pickle=allow_unsafe_pickle
            )
        except FileNotFoundError:
            report = None
        if report is None or lease.gone():
            raise CheckpointNotFoundError(f"{path} was removed while it was checked (by retention or `ckptd gc`)")
    return _report_problem(report, None, None, damage_only)


def _report_problem(
    report: VerifyReport, view: Path | None, location: S3Location | None, damage_only: bool = False
) -> str | None:
    # unsupported: not damaged, but ckptd cannot load it
    unsupported = [f for f in report.unsupported if f not in report.unknown_classes]
    errors = report.errors + ([] if damage_only else unsupported)
    if errors:
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        text = f"{errors[0].message.rstrip('.')}{more}"
    elif report.unreadable:
        first, n = report.unreadable[0].message, len(report.unreadable)
        more = f" (and {n - 1} more files could not be read)" if n > 1 else ""
        text = f"checking {report.checkpoint} failed: {first}{more}"
        raise StorageError(text.replace(str(view), str(location)) if view is not None else text)
    elif report.unknown_classes and not damage_only:
        # Not damage, and not judged: resumed past, an intact newest checkpoint (another writer's,
        # a newer version's) was left for an older one, and a save of its step replaced it.
        where = location if location is not None else report.checkpoint
        text = (
            f"{report.unknown_classes[0].message} A resume never falls back past a checkpoint it cannot "
            f"judge: to resume from an earlier one instead, move {where} out of the root."
        )
        raise UnknownClassError(text.replace(str(view), str(location)) if view is not None else text)
    else:
        return None
    return text.replace(str(view), str(location)) if view is not None else text


def resolve_latest(
    root: str | os.PathLike | S3Location,
    *,
    damaged: Mapping[str, str] | None = None,
    node_local: bool = False,
    log_fallback: bool = True,
    allow_unsafe_pickle: bool = False,
) -> LatestChoice | None:
    """The checkpoint of ``root`` to resume from (see the module docstring).

    ``damaged``: checkpoints a load found damaged (a checksum mismatch), with the reason; they are
    never chosen, as if the structural check had refused them. A key is a checkpoint's name (that
    name in any root: a commit read from several levels at once, as on node-local disks) or its
    full path or URL (that root's copy only: the mirror's copy of a commit stays a candidate when
    the local one is damaged). ``node_local``: ``root`` is one node's own disk (see
    :func:`structural_problem`). ``log_fallback`` False: the fallback's WARNING is left to the
    caller (``fallback_reason``), which may resume from another root instead.
    ``allow_unsafe_pickle``: the structural check unpickles any class ``.metadata`` names (the
    load that follows will, and its caller trusts the root)."""
    location = parse_location(root)
    cat = _without_damaged(scan_any(location, usage=False), damaged or {})
    tracker = location.url(TRACKER_FILE) if isinstance(location, S3Location) else location / TRACKER_FILE
    named = cat.latest()
    problem: str | None = None
    if named is not None:
        problem = structural_problem(named.path, node_local=node_local, allow_unsafe_pickle=allow_unsafe_pickle)
        if problem is None:
            return LatestChoice(named)
        why = f"tracker {tracker} names {named.name}, which is damaged: {problem}"
    elif cat.tracker_problem is not None:
        why = cat.tracker_problem
    elif cat.tracker_exists:
        why = f"tracker {tracker} names {cat.latest_name!r}, which is not a committed checkpoint"
    else:
        why = f"{root} has no tracker file '{TRACKER_FILE}'"
    # The tracker's branch first: a rollback's abandoned steps only when nothing of its own is left.
    candidates = [e for e in cat.branch_first if e.step >= 0 and not (named is not None and e.path == named.path)]
    off_branch = {e.name for e in cat.off_branch()}
    skipped: list[tuple[str, str]] = [] if named is None or problem is None else [(named.name, problem)]
    rejected: list[str] = []
    for entry in candidates:
        problem = structural_problem(entry.path, node_local=node_local, allow_unsafe_pickle=allow_unsafe_pickle)
        if problem is None:
            msg = f"{why}; resuming from the newest valid committed checkpoint {entry.name} instead"
            if entry.name in off_branch:
                msg = (
                    f"{why}, and no checkpoint of its branch is loadable; resuming from {entry.name}, on a "
                    f"branch a rollback abandoned (committed before {cat.latest_name}, which does not descend "
                    "from it): load another step explicitly if that is not what this job should continue from"
                )
            if rejected:
                msg += f" (skipped damaged newer ones: {'; '.join(rejected)})"
            if log_fallback:
                log.warning("%s", msg)
            return LatestChoice(entry, msg, tuple(skipped))
        rejected.append(f"{entry.name}: {problem}")
        skipped.append((entry.name, problem))
    if not cat.tracker_exists and not any(e.state is EntryState.INCOMPLETE for e in cat.entries) and not rejected:
        return None  # nothing was ever committed here: a fresh start
    detail = f"; damaged: {'; '.join(rejected)}" if rejected else ""
    raise CorruptCheckpointError(
        f"{why}, and no other committed checkpoint in {root} is loadable{detail}. Restore the "
        f"checkpoint from a backup, or move the damaged directories and '{TRACKER_FILE}' away to "
        "start from scratch."
    )


def damage_of(damaged: Mapping[str, str], entry: CheckpointEntry) -> str | None:
    """What a load found wrong with ``entry`` (``damaged``'s key: its full path or URL, or its
    name; see :func:`resolve_latest`), or None."""
    found = damaged.get(str(entry.path))
    return found if found is not None else damaged.get(entry.name)


def _without_damaged(cat: RootCatalog, damaged: Mapping[str, str]) -> RootCatalog:
    """``cat`` with the checkpoints in ``damaged`` taken out of the committed ones (a tracker naming
    one is not followed, and says why)."""
    if not damaged:
        return cat
    entries = [
        replace(e, state=EntryState.INCOMPLETE)
        if e.state is EntryState.COMMITTED and damage_of(damaged, e) is not None
        else e
        for e in cat.entries
    ]
    out = replace(cat, entries=entries)
    named = next((e for e in cat.entries if e.name == cat.latest_name), None)
    why = None if named is None else damage_of(damaged, named)
    if why is not None and cat.tracker_problem is None:
        out.tracker_problem = f"tracker of {cat.root} names {cat.latest_name}, which a load found damaged: {why}"
    return out


def resolve_resumable(
    root: str | os.PathLike | S3Location,
    *,
    damaged: Mapping[str, str] | None = None,
    node_local: bool = False,
    log_fallback: bool = True,
    allow_unsafe_pickle: bool = False,
) -> LatestChoice | None:
    """:func:`resolve_latest`, again (a fresh scan, ``_RESOLVE_TRIES`` in all) when it found nothing
    loadable or a checkpoint it was checking is gone: retention may have removed it meanwhile,
    after a newer one committed, which a fresh scan sees."""
    kwargs = {"node_local": node_local, "log_fallback": log_fallback, "allow_unsafe_pickle": allow_unsafe_pickle}
    for _ in range(_RESOLVE_TRIES - 1):
        try:
            return resolve_latest(root, damaged=damaged, **kwargs)
        except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
            log.info("resolving the latest checkpoint again (%s)", exc)
    return resolve_latest(root, damaged=damaged, **kwargs)
