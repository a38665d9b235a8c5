"""``python -m ckptd.commands <command> ...``: the offline commands without the daemon CLI."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
