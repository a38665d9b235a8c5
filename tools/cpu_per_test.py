"""CPU-seconds per test, the processes it started included: ``python -m pytest -p tools.cpu_per_test``.

The default suite keeps both cores of a CI machine busy, so its time is the CPU-seconds its tests
spend, mostly in the processes they start (ranks, daemons, servers, commands), which pytest's own
``--durations`` does not show. This plugin puts each pytest-xdist worker (or the single process
with ``-n0``) into a cgroup of its own, whose processes and their children it counts, and writes
one line per test: ``nodeid<TAB>cpu_s<TAB>wall_s<TAB>worker`` to ``$CPU_PER_TEST_OUT`` (default
``cpu_per_test.tsv`` in the working directory). Sum the lines per file to see where the suite's
time goes. It needs root and the cgroup v1 ``cpuacct`` controller at /sys/fs/cgroup/cpuacct
(else it says so once and counts nothing). The cgroups stay (empty) after the run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path("/sys/fs/cgroup/cpuacct")


def _cgroup() -> Path | None:
    """This process's own cpuacct cgroup (made and joined on first use); None if unavailable."""
    group = _ROOT / f"ckptd-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as exc:
        print(f"tools.cpu_per_test: no cpuacct cgroup here ({exc}); nothing is counted")
        return None
    return group


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is not None or config.getoption("numprocesses", None) in (None, 0):
        config.stash[_KEY] = _cgroup()


_KEY = pytest.StashKey[Path | None]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    group = item.config.stash.get(_KEY, None)
    if group is None:
        yield
        return
    usage = group / "cpuacct.usage"  # nanoseconds
    cpu0, wall0 = int(usage.read_text()), time.monotonic()
    yield
    cpu_s, wall_s = (int(usage.read_text()) - cpu0) / 1e9, time.monotonic() - wall0
    out = Path(os.environ.get("CPU_PER_TEST_OUT", "cpu_per_test.tsv"))
    with out.open("a") as f:
        f.write(f"{item.nodeid}\t{cpu_s:.2f}\t{wall_s:.2f}\t{os.environ.get('PYTEST_XDIST_WORKER', 'main')}\n")
