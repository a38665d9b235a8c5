"""The README's first command, shortened: train under torchrun, SIGKILL mid-run, resume, and
every loss equals the uninterrupted run bit for bit (tools/run_demo.py checks and exits 1 if not).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_demo_killed_and_resumed_matches_uninterrupted_run(tmp_path):
    runtime = tempfile.mkdtemp(prefix="ckd", dir="/tmp")
    env = {**os.environ, "CKPTD_RUNTIME_DIR": runtime}
    run = subprocess.run(
        [sys.executable, str(REPO / "tools" / "run_demo.py"), "--workdir", str(tmp_path / "demo"),
         "--steps", "12", "--save-every", "3", "--kill-at", "8"],
        env=env, capture_output=True, text=True, timeout=280, cwd=REPO,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "OK: killed at step 8" in run.stdout
    assert "missing []; differing []" in run.stdout
    # The killed run committed step 6 before dying; the resumed run re-ran 7..12 from it.
    assert (tmp_path / "demo" / "run" / "iter_0000012").is_dir()
    jobs = [p.stem for p in Path(runtime).glob("*.token")]  # one per checkpoint root the demo used
    assert len(jobs) == 2
    assert not [n for n in os.listdir("/dev/shm") if any(n.startswith(f"ckptd-{j}-") for j in jobs)]
    assert not list(Path(runtime).glob("*.pid"))  # run_demo stopped both daemons
    shutil.rmtree(runtime, ignore_errors=True)
