"""The commands of the ``ckptd`` CLI: daemon, status, ls, inspect, verify, convert, bench,
gc, tune.

Each module exposes ``register(subparsers)`` (adds its subparser, sets ``func=run``) and
``run(args) -> int`` (the exit status: 0 ok, 1 damage or failure, 2 usage error); a new command
is one more module in :data:`ALL`. Modules import their heavy dependencies inside ``run``.
``ckptd`` (``ckptd.cli``) and ``python -m ckptd.commands`` run :func:`main`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import bench, convert, daemon, gc, inspect, ls, status, tune, verify

ALL = [daemon, status, ls, inspect, verify, convert, bench, gc, tune]


def build_parser(prog: str = "ckptd") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="ckptd: asynchronous checkpoint daemon and tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in ALL:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "ckptd") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command != "daemon":  # the daemon sets up its own logging (INFO, to its log file)
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


__all__ = ["ALL", "build_parser", "main"]
