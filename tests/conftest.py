import logging
from pathlib import Path

import pytest

from tests.multiproc import clear_torchrun_env
from tests.schedule import file_rank


@pytest.fixture(autouse=True)
def _ckptd_debug_logging(caplog):
    caplog.set_level(logging.INFO, logger="ckptd")
    yield


@pytest.fixture
def single_process(monkeypatch):
    """This test process is a single process to ckptd, not a rank of a torchrun job (whose
    variables the test runner may have inherited)."""
    clear_torchrun_env(monkeypatch)


_UNIT = Path(__file__).parent / "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``process`` every test that starts processes, daemons or servers: each has a timeout
    (the project's rule), and every test outside ``tests/unit`` does. ``pytest -m "not process"``
    is then the inner loop of pure tests. Then the longest files first (tests/schedule.py), each
    file's tests in their order."""
    items.sort(key=lambda item: file_rank(item.path))
    for item in items:
        if item.get_closest_marker("timeout") is not None or _UNIT not in item.path.parents:
            item.add_marker(pytest.mark.process)
