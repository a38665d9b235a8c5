"""Stopping node daemons in tests and harnesses: SIGTERM (the daemon shuts down in order, as on
``ckptd daemon stop``), wait until each is gone, and SIGKILL what outlives the bound.

``stop_daemons(pid_paths, timeout_s)`` stops the daemons that hold those pid files and returns
their pids; ``stop_root_daemons(root, runtime_dir)`` finds the pid files of ``root``'s job on this
machine first. A daemon still running after ``timeout_s`` is SIGKILLed and the stop fails with
:class:`DaemonsDidNotStop` (an AssertionError: a test fails; a harness records it as a problem).
``daemon_processes(job)`` lists the daemon processes of a job, pid file or not.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from ckptd.client.admin import local_daemons
from ckptd.config import CkptdConfig
from ckptd.control.pidfile import daemon_alive, daemon_pid
from tools.harness.waiting import POLL_INTERVAL_S, exited

STOP_MARGIN_S = 10.0  # on top of the daemon's shutdown grace, as `ckptd daemon stop` waits


class DaemonsDidNotStop(AssertionError):
    """Daemons still ran ``timeout_s`` after SIGTERM (they were SIGKILLed)."""


def live_pid(pid_path: Path) -> int | None:
    """The pid of the daemon holding ``pid_path``'s lock (None when none does)."""
    return daemon_pid(pid_path) if daemon_alive(pid_path) else None


def daemon_processes(job: str) -> list[int]:
    """Daemon processes of ``job`` still running (the daemon's command line names the job)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "ckptd.cli" in cmd and job in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.pid)
    return found


def signal_process(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` unless it is gone already."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it exited meanwhile


def stop_daemons(pid_paths: Iterable[Path], timeout_s: float = 30.0, *, job: str | None = None) -> list[int]:
    """SIGTERM the daemon holding each of ``pid_paths`` and wait until every one exited; their pids.

    With ``job``, also wait until no daemon process of ``job`` is left (:func:`daemon_processes`),
    SIGTERMing each as it takes its pid file: a daemon launched by a trainer that was killed
    meanwhile may still be starting, and takes the pid-file lock only once the running one released
    it. After ``timeout_s``, SIGKILL what still runs and raise :class:`DaemonsDidNotStop`."""
    pid_paths = list(pid_paths)
    signalled: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        for path in pid_paths:
            pid = live_pid(path)
            if pid and pid not in signalled:
                signal_process(pid, signal.SIGTERM)
                signalled.append(pid)
        running = [pid for pid in signalled if not exited(pid)]
        running += [pid for pid in (daemon_processes(job) if job else []) if pid not in running]
        if not running:
            return signalled
        if time.monotonic() > deadline:
            for pid in running:
                signal_process(pid, signal.SIGKILL)
            raise DaemonsDidNotStop(f"daemon processes {running} still ran {timeout_s:.0f} s after SIGTERM")
        time.sleep(POLL_INTERVAL_S)


def stop_root_daemons(
    root: str | os.PathLike, runtime_dir: str | os.PathLike | None = None, timeout_s: float | None = None
) -> list[int]:
    """Stop every daemon of ``root``'s job on this machine (its runtime directory ``runtime_dir``, or
    the configured one) and wait until each exited; their pids. ``timeout_s`` defaults to the
    configured shutdown grace plus a margin, as ``ckptd daemon stop`` waits."""
    overrides: dict[str, Any] = {} if runtime_dir is None else {"runtime_dir": str(runtime_dir)}
    config = CkptdConfig.from_env(None, **overrides)
    pid_paths = [d.endpoints.pid_path for d in local_daemons(root, config)]
    return stop_daemons(pid_paths, config.shutdown_grace_s + STOP_MARGIN_S if timeout_s is None else timeout_s)
