import logging

import pytest

from tests.multiproc import clear_torchrun_env


@pytest.fixture(autouse=True)
def _ckptd_debug_logging(caplog):
    caplog.set_level(logging.INFO, logger="ckptd")
    yield


@pytest.fixture
def single_process(monkeypatch):
    """This test process is a single process to ckptd, not a rank of a torchrun job (whose
    variables the test runner may have inherited)."""
    clear_torchrun_env(monkeypatch)
