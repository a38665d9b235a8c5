"""``ckptd gc ROOT [--keep K]``: remove abandoned partial saves, and with ``--keep`` old committed
checkpoints."""

from __future__ import annotations

import argparse
from typing import Any

from ..catalog import CheckpointEntry
from ..errors import CkptdError
from ..retention import DEFAULT_GRACE_S, Removal, apply_gc, plan_gc
from ..s3catalog import scan_any
from ..storage.url import S3Location
from ._common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageError,
    add_parser,
    emit_json,
    format_bytes,
    guarded,
    resolve,
    warn,
)

DESCRIPTION = f"""\
Garbage-collect a checkpoint root:
  - with --keep K: keep the newest K committed checkpoints, and always the one the 'latest'
    tracker names; remove older committed ones. Without --keep no committed checkpoint is
    removed: only the leftovers below are
  - remove partial saves (iter_<step>.<attempt>.tmp) whose last write is older than --grace-s
    (default {DEFAULT_GRACE_S:.0f} s): younger ones may still be in flight
  - remove directories an interrupted gc left behind (*.deleting)
  - on an s3:// root, also abort unfinished multipart uploads older than --grace-s
Each directory is first renamed to <name>.deleting, then deleted, so an interrupted gc never
leaves a half-deleted checkpoint under a committed name. The tracker is never changed; when it
is unreadable or dangling, no committed checkpoint is removed. Prints every removal.

exit status: 0 ok; 1 a removal failed, or --keep was given and the tracker cannot be trusted;
2 usage error."""


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "gc", "remove abandoned partial saves, and old checkpoints with --keep", DESCRIPTION)
    p.add_argument("path", metavar="ROOT", help="checkpoint root")
    p.add_argument(
        "--keep",
        type=int,
        default=None,
        metavar="K",
        help="number of newest committed checkpoints to keep (>= 1); without it, no committed checkpoint is removed",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="minimum age of a partial (.tmp) save before it is removed (default: %(default)s)",
    )
    p.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _loadable(entry: CheckpointEntry) -> bool:
    """Whether a committed checkpoint's files are all there and well formed (no data is read: bit
    rot is what ``ckptd verify`` finds)."""
    from ..recovery import structural_problem  # torch: imported by the command that needs it

    try:
        return structural_problem(entry.path) is None
    except (CkptdError, OSError):  # removed meanwhile, or the storage did not answer: not known loadable
        return False


@guarded("gc")
def run(args: argparse.Namespace) -> int:
    if args.keep is not None and args.keep < 1:
        raise UsageError(
            f"--keep must be >= 1 (the tracker's checkpoint is always kept), got {args.keep}; "
            "leave --keep out to remove only abandoned saves and keep every committed checkpoint"
        )
    if args.grace_s < 0:
        raise UsageError(f"--grace-s must be >= 0, got {args.grace_s}")
    target = resolve(args.path)
    if not target.is_root:
        raise UsageError(
            f"{target.path} is a single checkpoint; gc works on a checkpoint root "
            "(the directory holding iter_* checkpoints and the 'latest' tracker)"
        )
    plan = plan_gc(scan_any(target.path), args.keep, args.grace_s, intact=_loadable)
    if args.dry_run:
        results: list[tuple[Removal, str | None]] = [(r, None) for r in plan.remove]
    elif isinstance(target.path, S3Location):
        from ..roots.s3_root import S3Root, apply_s3_gc  # torch: only for an s3:// root

        results = apply_s3_gc(S3Root(target.path), plan, args.grace_s)
    else:
        results = apply_gc(plan)
    failed = [(r, err) for r, err in results if err is not None]
    if args.json:
        emit_json(
            {
                "root": str(plan.root),
                "dry_run": args.dry_run,
                "refused": plan.refused,
                "removed" if not args.dry_run else "would_remove": [
                    {
                        "name": r.entry.name,
                        "state": r.entry.state.value,
                        "nbytes": r.entry.usage.nbytes,
                        "reason": r.reason,
                        **({"error": err} if err else {}),
                    }
                    for r, err in results
                ],
                "kept": [{"name": e.name, "state": e.state.value, "reason": why} for e, why in plan.kept],
            }
        )
    else:
        verb = "would remove" if args.dry_run else "removed"
        for r, err in results:
            if err is None:
                print(f"{verb} {r.entry.name} ({format_bytes(r.entry.usage.nbytes)}): {r.reason}")
            else:
                print(f"FAILED to remove {r.entry.name}: {err}")
        for e, why in plan.kept:
            print(f"kept {e.name}: {why}")
        done = [r for r, err in results if err is None]
        print(
            f"{verb} {len(done)} director{'y' if len(done) == 1 else 'ies'}, "
            f"{format_bytes(sum(r.entry.usage.nbytes for r in done))}"
        )
    if plan.refused is not None:
        warn("gc", plan.refused)
    return EXIT_FAILURE if failed or plan.refused is not None else EXIT_OK
