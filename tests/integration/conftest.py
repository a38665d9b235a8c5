"""Fixtures of the integration tests."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tools.harness.daemons import stop_root_daemons


@pytest.fixture
def single(single_process, tmp_path):
    """One process's root ``tmp_path/run``, its own runtime directory and the environment naming
    it: ``(root, runtime_dir, env)``; its daemon is stopped at the end."""
    runtime = tempfile.mkdtemp(prefix="cko", dir="/tmp")
    env = {**os.environ, "CKPTD_RUNTIME_DIR": runtime}
    yield tmp_path / "run", runtime, env
    stop_root_daemons(tmp_path / "run", runtime)
    shutil.rmtree(runtime, ignore_errors=True)
