"""Running the ``ckptd`` command line from tests, as a user's shell would.

- :func:`ckptd_cli`: ``python -m ckptd.cli ARGV``, a fresh interpreter; for the commands that start
  or talk to daemons (``ckptd daemon --detach`` forks the daemon from the command's own process,
  which must then be a fresh interpreter: the daemon imports no torch);
- :func:`offline_cli`: an offline command (``verify``, ``inspect``, ``ls``, ``gc``, ``convert``)
  run by ``ckptd.commands.main`` in a preloaded process (tools.harness.ranks): the same process
  boundary, exit code and output, without the 3 CPU-seconds a fresh interpreter spends importing
  torch for the commands that read ``.metadata``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from tools.harness.ranks import follow_std_fds, spawned

REPO = Path(__file__).resolve().parents[1]


def ckptd_cli(env: dict, *argv: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    """``python -m ckptd.cli ARGV`` with ``env``, from the repository; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "ckptd.cli", *argv], env=env, capture_output=True, text=True, timeout=timeout_s, cwd=REPO
    )


def _run_command(argv: list[str], cwd: str, out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    follow_std_fds()
    os.chdir(cwd)
    from ckptd.commands import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def offline_cli(
    *argv: str | os.PathLike, env: Mapping[str, str] | None = None, cwd: Path = REPO, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """``ckptd ARGV`` for an offline command, in a preloaded process with ``env`` (default: this
    process's environment); its exit code and output, as ``subprocess.run(..., text=True)`` gives
    them. Raises subprocess.TimeoutExpired when it runs past ``timeout_s`` (it is killed)."""
    args = [str(a) for a in argv]
    if args and args[0] == "daemon":
        raise ValueError("ckptd daemon forks the daemon from its own process: run it with ckptd_cli")
    with tempfile.TemporaryDirectory(prefix="ckcli") as d:
        out, err = Path(d) / "out", Path(d) / "err"
        out.touch()
        err.touch()
        with spawned(
            [(_run_command, (args, str(cwd), str(out), str(err)))], join_timeout_s=timeout_s, env=env
        ) as procs:
            procs[0].join(timeout_s)
        if procs.killed:
            raise subprocess.TimeoutExpired(["ckptd", *args], timeout_s)
        code = procs[0].exitcode
        return subprocess.CompletedProcess(
            ["ckptd", *args], -1 if code is None else code, out.read_text(), err.read_text()
        )
