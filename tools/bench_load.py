"""Same as ``ckptd bench load``: see ``ckptd bench load --help`` and :mod:`ckptd.bench.load`."""

import sys

from ckptd.bench.load import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
