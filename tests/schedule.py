"""The order in which pytest-xdist hands the suite's files to its workers: the longest first.

With ``--dist loadfile`` a file is one unit of work; a long file handed out last is the suite's
tail, run by one worker while the others are idle. xdist's own order (files with the most tests
first) hands out exactly those last: the long files hold one or two process scenarios each.
tests/conftest.py sorts the collected tests by :func:`file_rank` and pytest runs with
``--no-loadscope-reorder``, so the files below go first, longest first, then the rest in
collection order, ``tests/unit`` (short pure tests, the best filler) last.

The list: the longest files of ``python -m pytest --durations=0`` (setup, call and teardown summed
per file) on a 2-core machine; refresh it when a file's time changes by much. A file missing from
it only loses its place.
"""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent

LONGEST_FIRST = (
    "netns/test_link_faults.py",
    "integration/test_demo.py",
    "objstore/test_s3_faults.py",
    "netns/test_s3_link_cut.py",
    "objstore/test_s3_mirror.py",
    "objstore/test_s3_nodelocal.py",
    "integration/test_bench_all.py",
    "netns/test_nodes.py",
    "objstore/test_s3_mirror_nodes.py",
    "fault/test_attempts.py",
    "fault/test_crash_matrix.py",
    "integration/test_readme.py",
    "interop/test_dcp_features.py",
    "integration/test_backpressure.py",
    "objstore/test_s3_roots.py",
    "fault/test_fuzz_checkpoints.py",
    "interop/test_checksum_interop.py",
    "fault/test_node_faults.py",
    "fault/test_full_shm.py",
)


def file_rank(path: Path) -> int:
    """The place of the test file ``path`` in :data:`LONGEST_FIRST`; after them all if not in it."""
    try:
        return LONGEST_FIRST.index(path.resolve().relative_to(TESTS).as_posix())
    except ValueError:  # not listed, or outside tests/
        return len(LONGEST_FIRST)
