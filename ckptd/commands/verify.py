"""``ckptd verify DIR``: check a checkpoint end to end; exit 1 with a precise report on damage."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointRemovedError
from ..progress import Progress
from ..s3catalog import scan_any
from ..storage.url import Location
from ._common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_UNSUPPORTED,
    UsageError,
    add_parser,
    emit_json,
    format_bytes,
    guarded,
    resolve,
)

if TYPE_CHECKING:
    from ..verify import Finding, VerifyReport
    from ..verifyroot import RootVerifyReport

DESCRIPTION = """\
Verify a checkpoint end to end, without loading it into a model:
  - metadata.json names a supported backend (torch_dist v1, common torch v1)
  - .metadata (the torch DCP index) decodes
  - every tensor is covered exactly once: one dtype and global shape, chunks in bounds,
    no overlap, no gap
  - every data file exists and is long enough for its items; no two items share bytes
  - every item's bytes match the CRC-32 recorded at save time (ckptd records them; torch DCP
    and Megatron-Core do not, and the report says how many items had none)
  - with --deep: every item is a well-formed torch.save archive matching the CRC-32s it holds
    (checked without unpickling), and decodes weights-only as a tensor of the recorded shape
    and dtype (objects: as Megatron-Core's one-element list; a plain torch DCP checkpoint's
    non-tensor values, e.g. an iteration or optimizer param_groups: as any value)
  - common.pt matches its recorded CRC-32 and decodes weights-only
Given a checkpoint root, verifies the checkpoint its 'latest' tracker names (or, with --all,
every committed one) and checks the tracker. Progress is drawn on stderr when it is a terminal.

Status: OK; DAMAGED; UNREADABLE when a file could not be read and no damage was found (the
storage failed to return it: a network filesystem's ESTALE or EIO, too many open files, a
permission; nothing is known of its bytes: run verify again once the storage answers); or
UNSUPPORTED when the checkpoint uses a feature ckptd does not read (a torch DCP stream transform
such as ZStandard compression: torch.distributed.checkpoint.load reads it) or its .metadata names
a class ckptd does not know (a newer torch's or Megatron-Core's: upgrade ckptd, or pass
--allow-unsafe-pickle if the checkpoint is trusted): it is not damaged, but ckptd can neither
verify nor load it.

exit status: 0 sound (warnings and notes allowed); 1 damage found, or a file unreadable;
2 usage error; 3 unsupported (and no damage found)."""


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "verify", "check a checkpoint end to end (checksums, coverage, files)", DESCRIPTION)
    p.add_argument("path", metavar="DIR", help="checkpoint directory, or a checkpoint root")
    p.add_argument(
        "--deep", action="store_true", help="also decode every item (torch.load, weights-only) and check shape/dtype"
    )
    p.add_argument(
        "--all",
        action="store_true",
        dest="all_checkpoints",
        help="for a root: verify every committed checkpoint, not only the latest",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--allow-unsafe-pickle",
        action="store_true",
        help="decode .metadata, objects and common.pt with arbitrary pickles (only for trusted checkpoints)",
    )
    p.set_defaults(func=run)


def _finding_line(f: Finding) -> str:
    return f"  {f.severity.upper():7s} [{f.check}] {f.message}"


def _summary(r: VerifyReport) -> str:
    state = r.status
    if r.errors:
        state += f" ({len(r.errors)} error{'s' * (len(r.errors) != 1)})"
    parts = [
        f"{r.tensors} tensors, {r.objects} objects, {r.items} items in {r.data_files} data files",
        f"{format_bytes(r.bytes_read)} read",
        f"{r.items_checksummed} checksums checked",
    ]
    if r.deep:
        parts.append(f"{r.items_decoded} items decoded")
    lines = [f"{r.checkpoint}: {state}", f"  {'; '.join(parts)}"]
    lines.extend(_finding_line(f) for f in r.findings)
    return "\n".join(lines)


def _bar(path: Location) -> Progress:
    return Progress(0, f"verify {path.name}")


@guarded("verify")
def run(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    from ..verify import verify_checkpoint  # torch: imported by the command that needs it
    from ..verifyroot import verify_root, verify_unless_removed

    result: VerifyReport | RootVerifyReport
    if target.is_root:
        result = verify_root(
            scan_any(target.path),
            all_checkpoints=args.all_checkpoints,
            deep=args.deep,
            allow_unsafe_pickle=args.allow_unsafe_pickle,
            progress_for=_bar,
        )
        reports, root_findings = result.reports, result.findings
    else:
        if args.all_checkpoints:
            raise UsageError(f"--all needs a checkpoint root; {target.path} is one checkpoint")

        def verify() -> VerifyReport:
            with _bar(target.path) as bar:
                return verify_checkpoint(
                    target.path, deep=args.deep, allow_unsafe_pickle=args.allow_unsafe_pickle, progress=bar
                )

        checked = verify_unless_removed(target.path, verify)
        if checked is None:
            raise CheckpointRemovedError(
                f"{target.path} was removed (by retention or `ckptd gc`) before or while it was verified; "
                "nothing of it was judged"
            )
        result = checked
        reports, root_findings = [result], []
    if args.json:
        emit_json(result.to_dict())
    else:
        for f in root_findings:
            print(_finding_line(f))
        for r in reports:
            print(_summary(r))
        if target.is_root and len(reports) > 1:
            bad = sum(bool(r.errors) for r in reports)
            unreadable = sum(r.status == "UNREADABLE" for r in reports)
            unsupported = sum(r.status == "UNSUPPORTED" for r in reports)
            print(
                f"{len(reports)} checkpoints verified, {bad} damaged"
                + (f", {unreadable} unreadable" if unreadable else "")
                + (f", {unsupported} unsupported" if unsupported else "")
            )
    return {"OK": EXIT_OK, "UNSUPPORTED": EXIT_UNSUPPORTED}.get(result.status, EXIT_FAILURE)
