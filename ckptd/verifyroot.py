"""Verifying a checkpoint root: the tracker, and the checkpoints chosen from it (``ckptd verify
ROOT``); each checkpoint is verified by :func:`ckptd.verify.verify_checkpoint`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .catalog import EntryState, RootCatalog
from .format.rootlayout import TRACKER_FILE
from .verify import ERROR, NOTE, Finding, VerifyReport, verify_checkpoint


@dataclass
class RootVerifyReport:
    """Verification of a root: the tracker, and the checkpoints chosen from it."""

    root: str
    reports: list[VerifyReport] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings) and all(r.ok for r in self.reports)

    @property
    def status(self) -> str:
        """The worst status of the tracker and the checkpoints: DAMAGED, UNSUPPORTED, OK."""
        if any(f.severity == ERROR for f in self.findings) or any(r.errors for r in self.reports):
            return "DAMAGED"
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
                f"no '{TRACKER_FILE}' tracker in {cat.root}; verifying the "
                f"newest committed checkpoint {newest.name}",
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
        if progress_for is None:
            out.reports.append(verify_checkpoint(path, deep=deep, allow_unsafe_pickle=allow_unsafe_pickle))
        else:
            with progress_for(path) as bar:
                out.reports.append(
                    verify_checkpoint(path, deep=deep, allow_unsafe_pickle=allow_unsafe_pickle, progress=bar)
                )
    return out
