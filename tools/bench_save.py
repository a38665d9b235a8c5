"""Same as ``ckptd bench save``: see ``ckptd bench save --help`` and :mod:`ckptd.bench.save`."""

import sys

from ckptd.bench.save import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
