"""Paths a user gets wrong, with a real Checkpointer and the real command line: each is refused with
a message that names the path, says what is wrong with it and what to do, never with a raw
``OSError`` or a traceback.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ckptd
from ckptd.errors import DaemonError, StorageError
from tests.cli import ckptd_cli
from tests.multiproc import without_torchrun
from tools.harness.ranks import follow_std_fds, spawned

OTHER_UID = 65534

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


# What the daemon commands import when they run: imported before the privileges are dropped.
_COMMANDS_IMPORT = (
    "ckptd.client.admin",
    "ckptd.commands.daemon",
    "ckptd.commands.status",
    "ckptd.daemon.main",
    "ckptd.daemon.metrics",
    "ckptd.daemon.rootlock",
    "prometheus_client",
)


def _as_other_user(argv: list[str], out: str, err: str) -> None:
    """``ckptd ARGV`` as uid 65534 (a forkserver child: ckptd is imported before, since the
    interpreter's own directory may be root's only)."""
    for module in _COMMANDS_IMPORT:
        importlib.import_module(module)
    from ckptd.commands import main

    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    follow_std_fds()
    os.setgroups([])
    os.setgid(OTHER_UID)
    os.setuid(OTHER_UID)
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _cli_as_other_user(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="ckcli") as d:
        out, err = Path(d) / "out", Path(d) / "err"
        out.touch()
        err.touch()
        with spawned([(_as_other_user, (list(argv), str(out), str(err)))], join_timeout_s=60, env=env) as procs:
            procs[0].join(60)
        code = procs[0].exitcode
        return subprocess.CompletedProcess(argv, -1 if code is None else code, out.read_text(), err.read_text())


@pytest.mark.timeout(120)
def test_an_xdg_runtime_dir_of_another_user_is_an_error_naming_it(single, tmp_path):
    """XDG_RUNTIME_DIR naming another user's directory (a shell that kept it after ``su``):
    ``ckptd daemon stop`` and ``ckptd status`` failed with a raw PermissionError, and ``ckptd daemon``
    (as a Checkpointer: the same making of the directory) with one too. Another user's runtime
    directory that this user may enter (root, here) made ``ckptd status`` and ``ckptd daemon stop``
    say that no daemon runs."""
    if os.geteuid() != 0:
        pytest.skip("another user is played by uid 65534: needs root")
    root, _, _ = single
    env = without_torchrun(os.environ)
    env.pop("CKPTD_RUNTIME_DIR", None)
    # The user that set XDG_RUNTIME_DIR (root) keeps it 0700; its parent (/tmp) anyone may enter.
    xdg = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
    try:
        named = f"runtime directory {xdg / 'ckptd'} ($XDG_RUNTIME_DIR/ckptd)"
        for command in _DAEMON_COMMANDS:
            run = _cli_as_other_user({**env, "XDG_RUNTIME_DIR": str(xdg)}, *command, str(root))
            assert run.returncode == 1, (command, run.returncode, run.stdout, run.stderr)
            assert named in run.stderr and "Permission denied" in run.stderr, (command, run.stderr)
            assert "set XDG_RUNTIME_DIR to your session's (/run/user/65534)" in run.stderr, run.stderr
            assert "Traceback" not in run.stderr and "PermissionError" not in run.stderr, run.stderr
        # Another user's, which root may enter: refused, not searched for daemons.
        (xdg / "ckptd").mkdir(mode=0o700)
        for path in (xdg, xdg / "ckptd"):
            os.chown(path, OTHER_UID, OTHER_UID)
        _refused_everywhere({**env, "XDG_RUNTIME_DIR": str(xdg)}, str(root), f"{named} is owned by uid {OTHER_UID}")
    finally:
        shutil.rmtree(xdg, ignore_errors=True)
