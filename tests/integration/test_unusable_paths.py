"""Paths a user gets wrong, with a real Checkpointer and the real command line: each is refused with
a message that names the path, says what is wrong with it and what to do, never with a raw
``OSError`` or a traceback.
"""

from __future__ import annotations

import os

import pytest

import ckptd
from ckptd.errors import DaemonError, StorageError
from tests.cli import ckptd_cli
from tests.multiproc import without_torchrun

# What the daemon commands do with a runtime directory they cannot use: start a daemon (in the
# foreground, detached), ask for its status, stop it.
_DAEMON_COMMANDS = (("daemon", "--root"), ("daemon", "--detach", "--root"), ("status",), ("daemon", "stop", "--root"))


def _refused_everywhere(env: dict[str, str], root: str, *expected: str) -> None:
    for command in _DAEMON_COMMANDS:
        run = ckptd_cli(env, *command, root)
        assert run.returncode == 1, (command, run.returncode, run.stdout, run.stderr)
        for text in expected:
            assert text in run.stderr, (command, text, run.stderr)
        assert "Traceback" not in run.stderr and "no ckptd daemon" not in run.stdout, (command, run.stderr)


@pytest.mark.timeout(120)
def test_a_checkpoint_root_that_is_a_file_is_refused_saying_so(single, tmp_path):
    _, runtime, env = single
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime)
    with pytest.raises(StorageError, match=f"the checkpoint root {afile} is a file, not a directory: give"):
        ckptd.Checkpointer(afile, config=cfg)
    with pytest.raises(StorageError, match=f"{afile} is a file, not a directory, so the checkpoint root"):
        ckptd.Checkpointer(afile / "ckpts", config=cfg)
    for detach in ([], ["--detach"]):
        run = ckptd_cli(env, "daemon", "--root", str(afile), *detach)
        assert run.returncode == 1, (run.returncode, run.stderr)
        assert f"the checkpoint root {afile} is a file, not a directory" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr and "FileExistsError" not in run.stderr, run.stderr


@pytest.mark.timeout(120)
def test_a_runtime_dir_that_is_a_file_is_an_error_naming_the_variable(single, tmp_path):
    """``ckptd daemon`` printed a traceback, ``ckptd status`` said no daemon runs and ``ckptd daemon
    stop`` said so too, with exit 0."""
    root, runtime, _ = single
    afile = os.path.join(runtime, "f")
    with open(afile, "w") as f:
        f.write("not a directory")
    env = {**without_torchrun(os.environ), "CKPTD_RUNTIME_DIR": afile}
    what = f"runtime directory {afile} (CKPTD_RUNTIME_DIR) is not a directory; set CKPTD_RUNTIME_DIR to"
    _refused_everywhere(env, str(root), what)
    under = os.path.join(afile, "d")
    _refused_everywhere({**env, "CKPTD_RUNTIME_DIR": under}, str(root), f"{under} (CKPTD_RUNTIME_DIR) cannot be")
    with pytest.raises(DaemonError, match=r"\(CKPTD_RUNTIME_DIR\) is not a directory"):
        ckptd.Checkpointer(root, config=ckptd.CkptdConfig.from_env({}, runtime_dir=afile))
