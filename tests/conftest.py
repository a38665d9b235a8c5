import logging

import pytest


@pytest.fixture(autouse=True)
def _ckptd_debug_logging(caplog):
    caplog.set_level(logging.INFO, logger="ckptd")
    yield
