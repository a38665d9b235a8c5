"""Checkpoint converter: the same as ``ckptd convert`` (see ``ckptd convert --help``).

    python tools/convert_legacy.py to-dist /ckpts/legacy /ckpts/iter_0000100 [--split REGEX=AXIS ...]
    python tools/convert_legacy.py consolidate /ckpts/iter_0000100 model.pt [--with-common]
"""

from __future__ import annotations

import sys

from ckptd.commands import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
