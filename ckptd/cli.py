"""The ``ckptd`` command line: ``ckptd <command> ...``.

Each command lives in its own module exposing ``register(subparsers)`` (adds its subparser and
sets ``func``) and ``run(args) -> int`` (the exit status). :data:`COMMAND_MODULES` lists them by
import path; a new command is one more entry there. Modules are imported only when the parser is
built, and each imports its heavy dependencies inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# The daemon, then the offline tools (ls, inspect, verify, gc, tune: see ckptd.commands).
COMMAND_MODULES: tuple[str, ...] = ("ckptd.commands.daemon", "ckptd.commands")


def build_parser(prog: str = "ckptd") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="ckptd: asynchronous checkpoint daemon and tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "register"):
            module.register(subparsers)
        else:  # a package of commands (ckptd.commands): each entry of its ALL registers itself
            for command in module.ALL:
                command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command != "daemon":
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
