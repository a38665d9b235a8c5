"""What ``ckptd verify`` found in a checkpoint: findings and their severities, and the report
(:func:`ckptd.verify.verify_checkpoint` makes it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

ERROR = "error"
# The checkpoint uses a feature ckptd cannot read (a DCP stream transform): not damage, but not
# verified either, and not loadable by ckptd.
UNSUPPORTED = "unsupported"
# A file could not be opened or read (StorageError.reading): neither damaged nor verified. A
# resume's check raises it (ckptd.recovery.structural_problem), never falls back past it.
UNREADABLE = "unreadable"
# The check of an UNSUPPORTED finding that `.metadata` names a class ckptd does not know
# (UnknownClassError, most likely a newer torch's or Megatron-Core's): a resume's check raises it,
# as an unreadable file, rather than fall back past a checkpoint that may be intact.
UNKNOWN_CLASS = "class"
WARNING = "warning"
NOTE = "note"


class ProgressSink(Protocol):
    """Receives verification progress (e.g. :class:`ckptd.progress.Progress`)."""

    def set_total(self, total: int) -> None: ...

    def advance(self, n: int) -> None: ...


@dataclass
class Finding:
    """One result of a check: an error (damage), unsupported, unreadable, a warning, or a note."""

    severity: str
    check: str  # backend, metadata, class, coverage, file, range, checksum, decode, common, tracker
    message: str
    file: str | None = None
    item: str | None = None
    offset: int | None = None
    length: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class VerifyReport:
    """Everything :func:`verify_checkpoint` found in one checkpoint directory."""

    checkpoint: str
    deep: bool
    findings: list[Finding] = field(default_factory=list)
    tensors: int = 0
    objects: int = 0
    items: int = 0
    data_files: int = 0
    bytes_read: int = 0
    items_checksummed: int = 0
    items_without_checksum: int = 0
    items_decoded: int = 0

    @property
    def ok(self) -> bool:
        """Sound and fully checked: no error, nothing ckptd cannot read, no file unreadable."""
        return not any(f.severity in (ERROR, UNSUPPORTED, UNREADABLE) for f in self.findings)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR]

    @property
    def unsupported(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == UNSUPPORTED]

    @property
    def unknown_classes(self) -> list[Finding]:
        """The unsupported findings of classes ckptd does not know (:data:`UNKNOWN_CLASS`)."""
        return [f for f in self.unsupported if f.check == UNKNOWN_CLASS]

    @property
    def unreadable(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == UNREADABLE]

    @property
    def status(self) -> str:
        """``DAMAGED`` (any error), else ``UNREADABLE`` (a file the storage failed to return: not
        judged), else ``UNSUPPORTED`` (a feature or class ckptd cannot read), else ``OK``."""
        if self.errors:
            return "DAMAGED"
        return "UNREADABLE" if self.unreadable else "UNSUPPORTED" if self.unsupported else "OK"

    def add(self, severity: str, check: str, message: str, **where: Any) -> None:
        self.findings.append(Finding(severity, check, message, **where))

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "findings"}
        d["ok"] = self.ok
        d["status"] = self.status
        d["findings"] = [f.to_dict() for f in self.findings]
        return d
