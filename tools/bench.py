"""Same as ``ckptd bench all``: see ``ckptd bench all --help`` and :mod:`ckptd.bench.suite`."""
import sys
from ckptd.bench.suite import main
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
