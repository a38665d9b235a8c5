"""Starting and stopping a node daemon: pid-file lock, crash leftovers, signals, detaching.

Order of :func:`run_daemon`:

1. take the ``flock`` of ``<job>-n<node>.pid`` (another live daemon of this job and node holds
   it: exit with :data:`EXIT_BUSY`), write our pid into it; then this node's lock in the root
   (another job's daemon holds it: exit with :data:`EXIT_ROOT_BUSY`, see
   :mod:`ckptd.daemon.rootlock`);
2. clean up after a crashed predecessor: unlink the job's/node's ``/dev/shm`` segments; on
   node 0 (the coordinator) finish a commit that a crash interrupted after its rename (the tracker
   then names it), and remove every ``iter_*.tmp`` of the root (nothing can be in flight: a new
   coordinator knows no steps), or with several nodes adopt them (another node may still write);
3. bind the sockets, report readiness (``--detach``), serve until SIGTERM/SIGINT, ``SHUTDOWN``
   or (auto-started daemons) idleness;
4. orderly cleanup: in-flight writes and commits get ``shutdown_grace_s`` to finish, then every
   owned segment is unlinked and the socket and pid files are removed.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from ..config import CkptdConfig
from ..control.endpoints import Endpoints, ensure_private_dir, load_token
from ..control.keys import derive_keys
from ..control.pidfile import PidLock
from ..errors import CkptdError
from ..format.durable import make_dirs_durably
from ..format.safefs import dir_mode_for
from ..staging.segment import remove_orphans
from .rootlock import RootBusyError, RootLock
from .runfiles import RuntimeFiles
from .store import daemon_store

log = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Let training win the CPU and the disk queue: ``nice`` (0 keeps the priorities as they are)
    and, with it, the lowest best-effort I/O priority."""
    if nice <= 0:
        return
    os.nice(nice)
    try:
        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (AttributeError, OSError, psutil.Error) as exc:  # not Linux, or not permitted
        log.info("I/O priority left as it is: %s", exc)


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BUSY = 3  # another daemon of this job and node is running
EXIT_ROOT_BUSY = 4  # another job's daemon holds this node's lock in the checkpoint root


def run_daemon(
    ep: Endpoints,
    config: CkptdConfig,
    *,
    coordinator: bool,
    exit_when_idle: bool,
    nnodes: int = 1,
    ready: Callable[[str], None] = lambda _msg: None,
) -> int:
    """Run a node daemon in this process until it is stopped; returns the exit status."""
    ensure_private_dir(ep.runtime_dir, configured=bool(config.runtime_dir))
    lock = PidLock(ep.pid_path)
    if not lock.acquire():
        ready("busy")
        log.info("a daemon for %s node %d is running already", ep.root, ep.node)
        return EXIT_BUSY
    daemon = None
    runfiles: RuntimeFiles | None = None
    root_lock = RootLock(ep.root, ep.node, ep.job)
    try:
        if isinstance(ep.root, Path):
            make_dirs_durably(ep.root, fsync=config.fsync)
        # Before anything is cleaned up: what looks like a crash's leftovers may be another job's.
        root_lock.acquire(runtime_dir=ep.runtime_dir, job=ep.job)
        # torch/zmq imports only in a daemon that will run (seconds)
        from .node import NodeDaemon

        lower_priority(config.daemon_nice)
        # Every file and directory this process creates in the root gets config.file_mode
        # (directories: x wherever r is set), set once before any thread starts; the inherited
        # umask still narrows it, so a checkpoint is never more open than both allow.
        inherited = os.umask(0o077)
        os.umask(inherited | (0o777 & ~dir_mode_for(config.file_mode)))
        token = load_token(ep, config)
        keys = derive_keys(token)
        runfiles = RuntimeFiles(ep, lock, None if config.job_token else token, configured=bool(config.runtime_dir))
        stale = remove_orphans(ep.shm_prefix)
        if stale:
            log.warning("removed %d shared-memory segments left by a crashed daemon: %s", len(stale), stale[:4])
        store = daemon_store(ep.root, config)
        adopt: list[tuple[int, str]] = []
        if coordinator:
            recovered = store.recover(nnodes=nnodes)
            if recovered.finished:
                log.warning(
                    "the tracker now names %s: a crash had interrupted its commit after the checkpoint was complete",
                    recovered.finished,
                )
            if recovered.removed:
                log.warning("removed uncommitted saves left by a crash: %s", recovered.removed)
            for why in recovered.kept:
                log.warning("%s", why)
            # With several nodes other nodes may be writing these right now: adopted as steps in flight.
            adopt = recovered.adopted
        daemon = NodeDaemon(
            ep,
            config,
            keys,
            store,
            coordinator=coordinator,
            exit_when_idle=exit_when_idle,
            runfiles=runfiles,
            adopt=adopt,
            nnodes=nnodes,
        )

        def on_signal(signum: int, _frame: object) -> None:
            daemon.wake()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        ready("ready")
        # Everything allocated so far (torch's modules above all) lives as long as the daemon:
        # keep it out of the garbage collector's full collections, which would otherwise walk
        # it (~0.1-0.3 s each) while a SAVE of thousands of items waits for its acknowledgement.
        gc.freeze()
        daemon.run()
        return EXIT_OK
    except RootBusyError as exc:
        log.error("%s", exc)
        ready(f"error: {exc}")
        return EXIT_ROOT_BUSY
    except CkptdError as exc:  # says what and what to do: no traceback
        log.error("daemon failed: %s", exc)
        ready(f"error: {exc}")
        return EXIT_ERROR
    except Exception as exc:
        log.exception("daemon failed")
        ready(f"error: {type(exc).__name__}: {exc}")
        return EXIT_ERROR
    finally:
        try:
            if daemon is not None:
                daemon.close()
        finally:
            _exit_if_stuck(daemon)
        if root_lock.acquired:  # only a daemon that held the root cleans up its job's segments
            remove_orphans(ep.shm_prefix)
        root_lock.release()
        lock.release()
        if runfiles is not None:  # after the lock: a pid file it made again is never left unlocked
            runfiles.close()
        log.info("daemon exited")


def _exit_if_stuck(daemon: Any) -> None:
    """Leave at once (``os._exit``) when closing left a worker or mirror thread running (a
    NodeDaemon's ``stuck``): the interpreter's exit would join it. The locks are not released
    first: they go with the process, so a successor cannot take the root while the stuck write
    or rename may still land (a thread blocked in the kernel keeps the process, and its locks,
    until that call returns)."""
    if daemon is not None and daemon.stuck:
        log.error("daemon exiting without its stuck worker thread")
        logging.shutdown()
        os._exit(EXIT_ERROR)


def detach_and_run(
    ep: Endpoints, config: CkptdConfig, *, coordinator: bool, exit_when_idle: bool, nnodes: int, timeout_s: float
) -> int:
    """Fork a daemon into its own session; return once it is serving (0), busy (0) or failed (1).

    The parent's exit status tells the launching rank whether a daemon is up, without racing on
    sockets: the child reports over a pipe after binding its sockets.
    """
    ensure_private_dir(ep.runtime_dir, configured=bool(config.runtime_dir))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            logf = os.open(ep.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(logf, 1)
            os.dup2(logf, 2)
            if os.fork() != 0:  # the grandchild runs the daemon; it is reparented at once
                os._exit(0)
            logging.basicConfig(
                level=logging.INFO,
                stream=sys.stderr,
                force=True,
                format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
            )

            def ready(msg: str) -> None:
                try:
                    os.write(w, (msg + "\n").encode())
                except OSError:
                    pass

            code = run_daemon(
                ep, config, coordinator=coordinator, exit_when_idle=exit_when_idle, nnodes=nnodes, ready=ready
            )
        except BaseException:  # a forked child must never return into the caller
            logging.getLogger(__name__).exception("daemon child failed")
            code = EXIT_ERROR
        os._exit(code)
    os.close(w)
    os.waitpid(pid, 0)
    import select

    msg = b""
    deadline = time.monotonic() + timeout_s
    while not msg.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([r], [], [], remaining)[0]:
            break
        chunk = os.read(r, 4096)
        if not chunk:
            break
        msg += chunk
    os.close(r)
    text = msg.decode(errors="replace").strip()
    if text in ("ready", "busy"):
        return EXIT_OK
    log.error("the detached daemon %s; see %s", text or "did not report readiness in time", ep.log_path)
    return EXIT_ERROR
