"""Fixtures of the integration tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def single(single_process, tmp_path, runtime_dir):
    """One process's root ``tmp_path/run``, the test's runtime directory (the ``runtime_dir``
    fixture, which stops its daemon at the end) and the environment naming it:
    ``(root, runtime_dir, env)``."""
    yield tmp_path / "run", str(runtime_dir), {**os.environ, "CKPTD_RUNTIME_DIR": str(runtime_dir)}
