"""The tool commands of the ``ckptd`` CLI: status, ls, inspect, verify, convert, bench,
gc, tune.

Each module exposes ``register(subparsers)`` (adds its subparser, sets ``func=run``) and
``run(args) -> int`` (the exit status: 0 ok, 1 damage or failure, 2 usage error). ``ckptd.cli``
wires them in with::

    for command in commands.ALL:
        command.register(subparsers)

``python -m ckptd.commands <command> ...`` runs them without the rest of the CLI. ``ckptd daemon``
(:mod:`.daemon`) is wired in by ``ckptd.cli`` on its own: a daemon in the foreground sets up its
logging itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import bench, convert, gc, inspect, ls, status, tune, verify

ALL = [status, ls, inspect, verify, convert, bench, gc, tune]


def build_parser(prog: str = "ckptd") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="ckptd offline checkpoint tools")
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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


__all__ = ["ALL", "build_parser", "main"]
