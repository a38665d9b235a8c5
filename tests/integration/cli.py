"""Running the ``ckptd`` command line from tests, as a user's shell would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def ckptd_cli(env: dict, *argv: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    """``python -m ckptd.cli ARGV`` with ``env``, from the repository; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli", *argv], env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO
    )
