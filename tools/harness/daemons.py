"""Stopping node daemons in tests and harnesses: SIGTERM (the daemon shuts down in order, as on
``ckptd daemon stop``), wait until each is gone, and SIGKILL what outlives the bound.

``stop_daemons(pid_paths, timeout_s)`` stops the daemons that hold those pid files and returns
their pids; ``stop_root_daemons(root, runtime_dir)`` finds the pid files of ``root``'s job on this
machine first; ``stop_runtime_dir(runtime_dir, keep_logs)`` stops every daemon of a runtime
directory, keeps their logs and returns what they left behind, and ``private_runtime_dir(keep_logs)``
makes a runtime directory that it stops, checks and removes at the end. A daemon still running after
``timeout_s`` is SIGKILLed and the stop fails with :class:`DaemonsDidNotStop` (an AssertionError:
a test fails; a harness records it as a problem). ``daemon_processes(job)`` lists the daemon
processes of a job, pid file or not.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil

from ckptd.client.admin import local_daemons
from ckptd.config import CkptdConfig
from ckptd.control.pidfile import daemon_alive, daemon_pid
from ckptd.staging.segment import list_segments
from tools.harness.waiting import POLL_INTERVAL_S, exited

# On top of the daemon's shutdown grace: a test's daemon finishes its work within one grace (ckptd
# daemon stop allows the two a stuck write may take: ckptd.client.admin.stop_bound_s).
STOP_MARGIN_S = 10.0


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
        unnamed = False  # a daemon holds a pid file's lock but has not written its pid yet
        for path in pid_paths:
            if not daemon_alive(path):
                continue
            pid = daemon_pid(path)
            if pid is None:
                unnamed = True
            elif pid not in signalled:
                signal_process(pid, signal.SIGTERM)
                signalled.append(pid)
        running = [pid for pid in signalled if not exited(pid)]
        running += [pid for pid in (daemon_processes(job) if job else []) if pid not in running]
        if not running and not unnamed:
            return signalled
        if time.monotonic() > deadline:
            for pid in running:
                signal_process(pid, signal.SIGKILL)
            held = " (and a pid file held by a process that never wrote its pid)" if unnamed else ""
            raise DaemonsDidNotStop(f"daemon processes {running}{held} still ran {timeout_s:.0f} s after SIGTERM")
        time.sleep(POLL_INTERVAL_S)


def stop_root_daemons(
    root: str | os.PathLike, runtime_dir: str | os.PathLike | None = None, timeout_s: float | None = None
) -> list[int]:
    """Stop every daemon of ``root``'s job on this machine (its runtime directory ``runtime_dir``, or
    the configured one) and wait until each exited; their pids. ``timeout_s`` defaults to the
    configured shutdown grace plus a margin (:data:`STOP_MARGIN_S`)."""
    overrides: dict[str, Any] = {} if runtime_dir is None else {"runtime_dir": str(runtime_dir)}
    config = CkptdConfig.from_env(None, **overrides)
    pid_paths = [d.endpoints.pid_path for d in local_daemons(root, config)]
    return stop_daemons(pid_paths, config.shutdown_grace_s + STOP_MARGIN_S if timeout_s is None else timeout_s)


# <job>-n<node>.{pid,sock,log} and <job>.token (ckptd.control.endpoints.Endpoints names them).
_JOB_FILE = re.compile(r"^(?P<job>.+?)(?:-n\d+\.(?:pid|sock|log)|\.token)$")


def runtime_dir_jobs(runtime_dir: Path) -> list[str]:
    """The jobs that have a pid file, socket, log or token in ``runtime_dir``."""
    names = (_JOB_FILE.match(p.name) for p in runtime_dir.iterdir()) if runtime_dir.is_dir() else ()
    return sorted({m["job"] for m in names if m})


def stop_runtime_dir(runtime_dir: Path, keep_logs: Path, timeout_s: float | None = None) -> list[str]:
    """Stop every daemon with a pid file in ``runtime_dir`` (:func:`stop_daemons`; ``timeout_s``
    defaults to the default shutdown grace plus a margin, :data:`STOP_MARGIN_S`), copy the
    daemons' logs into ``keep_logs``, and return what was left behind: daemons that had to be
    SIGKILLed, and staging segments in /dev/shm of the directory's jobs. The directory stays."""
    problems: list[str] = []
    jobs = runtime_dir_jobs(runtime_dir)
    bound_s = CkptdConfig().shutdown_grace_s + STOP_MARGIN_S if timeout_s is None else timeout_s
    try:
        stop_daemons(runtime_dir.glob("*.pid"), bound_s)
    except DaemonsDidNotStop as exc:
        problems.append(str(exc))
    finally:
        for log_file in runtime_dir.glob("*.log"):  # kept with the test's files, for a failure's story
            keep_logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(log_file, keep_logs / log_file.name)
    for job in sorted(set(jobs) | set(runtime_dir_jobs(runtime_dir))):
        problems += [f"/dev/shm/{name}" for name in list_segments(f"ckptd-{job}-")]
    return problems


@contextlib.contextmanager
def private_runtime_dir(keep_logs: Path, timeout_s: float | None = None) -> Iterator[Path]:
    """A new private runtime directory (mode 0700), ``/tmp/ck<random>``: short, since a daemon's
    ``ipc://`` socket path in it may have at most 107 bytes. At the end,
    :func:`stop_runtime_dir` (``keep_logs``, ``timeout_s``), and the directory is removed; then,
    unless the body raised, an AssertionError if a daemon had to be killed or a staging segment of
    the directory's jobs is left."""
    path = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
    try:
        yield path
    finally:
        try:
            problems = stop_runtime_dir(path, keep_logs, timeout_s)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    if problems:
        raise AssertionError(f"left behind in {path}: {problems}")
