"""The README's example runs as printed: the first run saves, the second resumes from it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(180)
def test_readme_example_saves_then_resumes(tmp_path):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 22
    runtime = tempfile.mkdtemp(prefix="ckr", dir="/tmp")
    env = {**os.environ, "CKPTD_RUNTIME_DIR": runtime, "CKPTD_IDLE_EXIT_S": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(var, None)
    outs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(run.stdout)
    assert "latest committed step: 15" in outs[0]
    assert "latest committed step: 35" in outs[1]  # resumed at 16, saved 20..35
    assert sorted(p.name for p in (tmp_path / "ckpts" / "run1").glob("iter_*")) == [
        f"iter_{s:07d}" for s in (0, 5, 10, 15, 20, 25, 30, 35)]
    subprocess.run([sys.executable, "-m", "ckptd.cli", "daemon", "stop", "--root", str(tmp_path / "ckpts" / "run1")],
                   env=env, timeout=60, check=True, capture_output=True)
    shutil.rmtree(runtime)
