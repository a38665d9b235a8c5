import compileall
import faulthandler
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multiproc import clear_torchrun_env
from tests.schedule import file_rank
from tools.harness.daemons import private_runtime_dir


@pytest.fixture(autouse=True)
def _ckptd_debug_logging(caplog):
    caplog.set_level(logging.INFO, logger="ckptd")
    yield


@pytest.fixture
def single_process(monkeypatch):
    """This test process is a single process to ckptd, not a rank of a torchrun job (whose
    variables the test runner may have inherited)."""
    clear_torchrun_env(monkeypatch)


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Iterator[Path]:
    """The test's private runtime directory, ``/tmp/ck<random>`` (``tmp_path`` is too long for the
    107 bytes of an ``ipc://`` socket path): pass it as ``CKPTD_RUNTIME_DIR`` or ``runtime_dir=``.
    At teardown every daemon with a pid file in it is stopped (SIGTERM, then SIGKILL past the
    shutdown grace and a margin), their logs are copied to ``tmp_path/daemon-logs``, the directory
    is removed, and the test fails if a daemon had to be killed or a staging segment of one of its
    jobs is left in /dev/shm (tools.harness.daemons.private_runtime_dir)."""
    with private_runtime_dir(tmp_path / "daemon-logs") as path:
        yield path


_UNIT = Path(__file__).parent / "unit"
_REPO = Path(__file__).resolve().parents[1]
# The test process's own stderr, kept before any test's output is captured.
_STDERR_FD = pytest.StashKey[int]()
# How long before its timeout a test's stacks are written (see pytest_runtest_protocol).
STACKS_BEFORE_TIMEOUT_S = 5.0


def pytest_configure(config: pytest.Config) -> None:
    """Compile the repository's modules once, before the workers start: the suite starts a few
    hundred interpreters (daemons, CLI commands, trainers), and where PYTHONDONTWRITEBYTECODE is
    set (CI's machines set it) each of them compiled ckptd from source again, 0.2-0.6 CPU-s apiece
    on 2 cores the suite keeps busy. Stale files are recompiled (mtime), nothing else changes."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        for package in ("ckptd", "tools", "tests", "benchmarks"):
            compileall.compile_dir(_REPO / package, quiet=2)
    config.stash[_STDERR_FD] = os.dup(2)


def pytest_unconfigure(config: pytest.Config) -> None:
    fd = config.stash.get(_STDERR_FD, None)
    if fd is not None:
        os.close(fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Write every thread's stacks to the test process's stderr shortly before the test's timeout.
    The timeout (pytest-timeout's thread method) writes its own dump to the test worker's output,
    which pytest-xdist does not show: CI printed "worker 'gw0' crashed while running ..." and
    nothing of where the test hung. The worker's stderr reaches CI's log."""
    marker = item.get_closest_marker("timeout")
    timeout_s = float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout"))
    fd = item.config.stash.get(_STDERR_FD, None)
    armed = fd is not None and timeout_s > STACKS_BEFORE_TIMEOUT_S
    if armed:
        faulthandler.dump_traceback_later(timeout_s - STACKS_BEFORE_TIMEOUT_S, file=fd)
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``process`` every test that starts processes, daemons or servers: each has a timeout
    (the project's rule), and every test outside ``tests/unit`` does. ``pytest -m "not process"``
    is then the inner loop of pure tests. Then the longest files first (tests/schedule.py), each
    file's tests in their order."""
    items.sort(key=lambda item: file_rank(item.path))
    for item in items:
        if item.get_closest_marker("timeout") is not None or _UNIT not in item.path.parents:
            item.add_marker(pytest.mark.process)
