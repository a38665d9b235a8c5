"""Verifying a checkpoint root: the tracker, and the checkpoints chosen from it (``ckptd verify
ROOT``); each checkpoint is verified by :func:`ckptd.verify.verify_checkpoint`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .catalog import EntryState, RootCatalog
from .errors import CheckpointNotFoundError, CheckpointRemovedError
from .format.commitrecord import COMMIT_RECORD
from .format.lease import ReadLease
from .format.rootlayout import TRACKER_FILE
from .storage.url import Location, S3Location
from .verify import ERROR, NOTE, WARNING, Finding, VerifyReport, verify_checkpoint


@dataclass
class RootVerifyReport:
    """Verification of a root: the tracker, and the checkpoints chosen from it."""

    root: str
    reports: list[VerifyReport] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    # Checkpoints chosen that were removed while verified, none of them judged.
    removed: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def status(self) -> str:
        """The worst status of the tracker and the checkpoints: DAMAGED, UNREADABLE (a file the
        storage failed to return), UNSUPPORTED, OK; or UNVERIFIED when every checkpoint chosen was
        removed before it could be judged."""
        if any(f.severity == ERROR for f in self.findings) or any(r.errors for r in self.reports):
            return "DAMAGED"
        if any(r.unreadable for r in self.reports):
            return "UNREADABLE"
        if self.removed and not self.reports:
            return "UNVERIFIED"
        return "UNSUPPORTED" if any(r.unsupported for r in self.reports) else "OK"

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "ok": self.ok,
            "status": self.status,
            "findings": [f.to_dict() for f in self.findings],
            "checkpoints": [r.to_dict() for r in self.reports],
        }


def select_for_verify(cat: RootCatalog, all_checkpoints: bool) -> tuple[list[Path], list[Finding]]:
    """The checkpoints of a root to verify: the tracker's (or every committed one, and every one under
    a committed name that lost its markers), plus findings.

    Without a tracker the newest committed checkpoint is chosen (and a note says so).
    """
    findings: list[Finding] = []
    if cat.tracker_problem is not None:
        findings.append(Finding(ERROR, "tracker", cat.tracker_problem, file=TRACKER_FILE))
    if all_checkpoints:
        # With the committed ones, those under a committed name that lost their markers: committed
        # once (only a commit renames into the name), damaged now.
        chosen = [e.path for e in cat.entries if e.state in (EntryState.COMMITTED, EntryState.INCOMPLETE)]
    elif (latest := cat.latest()) is not None:
        chosen = [latest.path]
    elif not cat.tracker_exists and cat.committed:
        # What a resume would load: the last committed (commit order: after a rollback a lower
        # step is newer than the abandoned higher ones), not the highest step.
        newest = cat.branch_first[0]
        chosen = [newest.path]
        findings.append(
            Finding(
                NOTE,
                "tracker",
                f"no '{TRACKER_FILE}' tracker in {cat.root}; verifying the newest committed checkpoint {newest.name}",
            )
        )
    else:
        chosen = []
    if not chosen and cat.tracker_problem is None:
        findings.append(Finding(ERROR, "tracker", f"{cat.root} holds no committed checkpoint"))
    return chosen, findings


def verify_root(
    cat: RootCatalog,
    *,
    all_checkpoints: bool = False,
    deep: bool = False,
    allow_unsafe_pickle: bool = False,
    progress_for: Any = None,
) -> RootVerifyReport:
    """Verify the tracker's checkpoint (or all committed ones) of a scanned root.

    ``progress_for(path)`` may return a context-managed :class:`ProgressSink` per checkpoint.
    """
    chosen, findings = select_for_verify(cat, all_checkpoints)
    out = RootVerifyReport(str(cat.root), findings=findings)
    for path in chosen:

        def verify(path: Any = path) -> VerifyReport:
            if progress_for is None:
                return verify_checkpoint(path, deep=deep, allow_unsafe_pickle=allow_unsafe_pickle)
            with progress_for(path) as bar:
                return verify_checkpoint(path, deep=deep, allow_unsafe_pickle=allow_unsafe_pickle, progress=bar)

        report = verify_unless_removed(path, verify)
        if report is None:
            out.removed += 1
            out.findings.append(
                Finding(
                    WARNING,
                    "file",
                    f"{path} was removed (by retention or `ckptd gc`) before or while it was verified; "
                    "nothing of it was judged. Run verify again for what the root holds now",
                )
            )
        else:
            out.reports.append(report)
    return out


def verify_unless_removed(path: Location, verify: Callable[[], VerifyReport]) -> VerifyReport | None:
    """``verify()`` of the checkpoint at ``path``, or None when retention or ``ckptd gc`` removed
    it meanwhile: its files going one by one would read as damage. A directory is verified under a
    load's lease, which postpones its removal (ckptd.format.lease); a checkpoint in an object store
    (no lease) whose report finds errors is taken for removed when its commit object is gone, the
    first object a removal deletes, and was there before."""
    if isinstance(path, S3Location):
        from .storage.s3client import S3Client

        client = S3Client(path)
        had_record = client.head(COMMIT_RECORD) is not None  # a checkpoint another tool wrote has none
        report = verify()
        if report.errors and had_record and client.head(COMMIT_RECORD) is None:
            return None
        return report
    try:
        with ReadLease.acquire(path) as lease:
            report = verify()
            return None if lease.gone() else report
    except (CheckpointRemovedError, CheckpointNotFoundError):
        return None
