"""``ckptd ls ROOT``: the checkpoints of a root, with steps, states, sizes and the latest one."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..catalog import CheckpointEntry, EntryState, dir_usage, is_checkpoint_dir
from ..s3catalog import s3_checkpoint_entry, scan_any
from ..storage.url import Location, S3Location
from ._common import (
    EXIT_FAILURE,
    EXIT_OK,
    add_parser,
    age,
    emit_json,
    format_bytes,
    guarded,
    resolve,
    table,
    warn,
)

DESCRIPTION = """\
List the checkpoints under a checkpoint root: committed ones (iter_<step>), partial ones
(iter_<step>.<attempt>.tmp: in flight or abandoned), and directories a gc run left half-deleted.
The one the 'latest' tracker names is marked with '*'. Given a single checkpoint directory,
lists just that one.

exit status: 0 ok; 1 the tracker is unreadable or names a missing/incomplete checkpoint;
2 usage error (path missing or not a checkpoint/root)."""


def register(subparsers: Any) -> None:
    p = add_parser(subparsers, "ls", "list committed and partial checkpoints of a root", DESCRIPTION)
    p.add_argument("path", metavar="ROOT", help="checkpoint root (or one checkpoint directory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def _entry_dict(e: CheckpointEntry, now: float) -> dict[str, Any]:
    return {
        "name": e.name,
        "path": str(e.path),
        "step": e.step if e.step >= 0 else None,
        "state": e.state.value,
        "latest": e.is_latest,
        "nbytes": e.usage.nbytes,
        "files": e.usage.files,
        "mtime": e.usage.newest_mtime,
        "age_s": round(now - e.usage.newest_mtime, 3),
    }


@guarded("ls")
def run(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    now = time.time()
    path = target.path
    latest: str | None = None
    problem: str | None = None
    root: Location = path.parent
    if not target.is_root and isinstance(path, S3Location):
        entries = [s3_checkpoint_entry(path)]
    elif not target.is_root and isinstance(path, Path):
        state = EntryState.COMMITTED if is_checkpoint_dir(path) else EntryState.INCOMPLETE
        entries = [CheckpointEntry(path.name, path, -1, state, dir_usage(path))]
    else:
        cat = scan_any(target.path)
        entries, root, latest, problem = cat.entries, cat.root, cat.latest_name, cat.tracker_problem
    if args.json:
        emit_json(
            {
                "root": str(root),
                "latest": latest,
                "tracker_problem": problem,
                "checkpoints": [_entry_dict(e, now) for e in entries],
            }
        )
    else:
        rows = [
            (
                "*" if e.is_latest else "",
                e.name,
                e.step if e.step >= 0 else "-",
                e.state.value,
                format_bytes(e.usage.nbytes),
                e.usage.files,
                age(e.usage.newest_mtime, now),
            )
            for e in entries
        ]
        print(f"{root}  (latest: {latest or '-'})")
        if rows:
            print(table(("", "NAME", "STEP", "STATE", "SIZE", "FILES", "AGE"), rows, right=(2, 4, 5, 6)))
        else:
            print("no checkpoints")
    if problem is not None:
        warn("ls", problem)
        return EXIT_FAILURE
    return EXIT_OK
