"""The ``ckptd`` command line: ``ckptd <command> ...``; every command lives in ckptd.commands."""

from __future__ import annotations

import sys

from .commands import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
