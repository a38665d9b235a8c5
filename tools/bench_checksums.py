"""Same as ``ckptd bench checksums``: see ``ckptd bench checksums --help`` and :mod:`ckptd.bench.checksums`."""

import sys

from ckptd.bench.checksums import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
