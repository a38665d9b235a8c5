"""Shared pieces of the offline commands: exit codes, error output, JSON, tables, targets."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..catalog import RootCatalog, Target, resolve_target
from ..errors import CheckpointNotFoundError, CkptdError
from ..format.rootlayout import TRACKER_FILE
from ..progress import format_bytes, format_duration
from ..s3catalog import resolve_s3_target, scan_any
from ..storage.url import Location, S3Location, UnsupportedLocationError, parse_location

EXIT_OK = 0
EXIT_FAILURE = 1  # damage found, or the operation failed
EXIT_USAGE = 2  # bad arguments or a path that is not a checkpoint (argparse also uses 2)
EXIT_UNSUPPORTED = 3  # verify: the checkpoint uses a feature ckptd does not read (not damage)


class UsageError(Exception):
    """Raised inside a command's run() for a usage problem; turned into exit code 2."""


def error(command: str, message: str) -> None:
    print(f"ckptd {command}: error: {message}", file=sys.stderr)


def warn(command: str, message: str) -> None:
    print(f"ckptd {command}: warning: {message}", file=sys.stderr)


def guarded(command: str) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Turn a command body's exceptions into a one-line message and a conventional exit code."""

    def wrap(body: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(body)
        def run(args: argparse.Namespace) -> int:
            try:
                return body(args)
            except UsageError as exc:
                error(command, str(exc))
                return EXIT_USAGE
            except (CkptdError, OSError) as exc:
                error(command, str(exc))
                return EXIT_FAILURE

        return run

    return wrap


def emit_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def add_parser(subparsers: Any, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def resolve(path: str) -> Target:
    """What ``path`` names: a checkpoint or a root, a directory or an ``s3://`` prefix."""
    try:
        location = parse_location(path)
        if isinstance(location, S3Location):
            return resolve_s3_target(location)
        return resolve_target(location)
    except (CheckpointNotFoundError, UnsupportedLocationError) as exc:  # a path or URL that names nothing
        raise UsageError(str(exc)) from None


def checkpoint_of(target: Target, command: str) -> tuple[Location, RootCatalog | None]:
    """The checkpoint a command acts on: the path itself, or the one a root's tracker names."""
    if not target.is_root:
        return target.path, None
    cat = scan_any(target.path)
    latest = cat.latest()
    if latest is not None:
        return latest.path, cat
    if cat.tracker_problem is not None:
        raise CheckpointNotFoundError(cat.tracker_problem)
    if cat.committed:
        newest = cat.committed[-1]
        warn(command, f"no '{TRACKER_FILE}' tracker in {cat.root}; using the newest committed checkpoint {newest.name}")
        return newest.path, cat
    raise CheckpointNotFoundError(f"{target.path} holds no committed checkpoint")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Plain-text columns; ``right`` lists the column indexes aligned right (numbers)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def age(mtime: float, now: float | None = None) -> str:
    return format_duration((time.time() if now is None else now) - mtime)


__all__ = [
    "EXIT_OK",
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "UsageError",
    "guarded",
    "error",
    "warn",
    "emit_json",
    "add_parser",
    "resolve",
    "checkpoint_of",
    "table",
    "age",
    "format_bytes",
]
