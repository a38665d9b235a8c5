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
    "integration/test_demo.py",
    "netns/test_link_faults.py",
    "objstore/test_s3_faults.py",
    "netns/test_s3_link_cut.py",
    "fault/test_fuzz_checkpoints.py",
    "objstore/test_s3_roots.py",
    "netns/test_crash_matrix_netns.py",
    "integration/test_bench_train.py",
    "objstore/test_s3_mirror.py",
    "integration/test_bench_all.py",
    "real/test_megatron_gpt.py",
    "real/test_convert_mcore.py",
    "fault/test_crash_matrix.py",
)


def file_rank(path: Path) -> int:
    """The place of the test file ``path`` in :data:`LONGEST_FIRST`; after them all if not in it."""
    try:
        return LONGEST_FIRST.index(path.resolve().relative_to(TESTS).as_posix())
    except ValueError:  # not listed, or outside tests/
        return len(LONGEST_FIRST)
