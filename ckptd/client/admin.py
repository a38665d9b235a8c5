"""Talking to the node daemons of a checkpoint root from tools: find them, ask STATUS, stop them.

Used by ``ckptd status`` and ``ckptd daemon stop``; training code uses the Checkpointer instead.
Only daemons on this machine are reachable (their ``ipc://`` sockets live in the runtime dir).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import zmq

from ..config import CkptdConfig
from ..control.channel import Channel, make_socket
from ..control.codec import Codec
from ..control.endpoints import Endpoints, JobEnv, load_token, runtime_dir_exists
from ..control.keys import derive_keys
from ..control.pidfile import daemon_alive, daemon_pid
from ..control.protocol import Message, Shutdown, ShutdownAck, Status, StatusReply
from ..control.requests import RequestClient
from ..errors import DaemonError, DaemonLostError, ProtocolError

M = TypeVar("M", bound=Message)
# Beyond a daemon's orderly stop: the process's exit (its rings unmapped, the interpreter's end).
STOP_EXIT_MARGIN_S = 10.0
_JOB = re.compile(r"^[A-Za-z0-9_-]{1,40}$")  # what Endpoints.for_job accepts


@dataclass(frozen=True)
class LocalDaemon:
    node: int
    endpoints: Endpoints
    pid: int | None


def local_daemons(root: str | os.PathLike, config: CkptdConfig | None = None) -> list[LocalDaemon]:
    """The live daemons of ``root``'s job on this machine, by node id (a held pid-file lock = live).
    A runtime directory that cannot be one is a DaemonError (ckptd.control.endpoints.runtime_dir_exists)."""
    config = config if config is not None else CkptdConfig.from_env()
    base = Endpoints.for_job(root, JobEnv(), config)
    pattern = re.compile(rf"^{re.escape(base.job)}-n(\d+)\.pid$")
    found = []
    if runtime_dir_exists(base.runtime_dir, configured=bool(config.runtime_dir)):
        for path in sorted(base.runtime_dir.iterdir()):
            m = pattern.match(path.name)
            if m and daemon_alive(path):
                ep = replace(base, node=int(m.group(1)))
                found.append(LocalDaemon(ep.node, ep, daemon_pid(path)))
    return sorted(found, key=lambda d: d.node)


@dataclass(frozen=True, kw_only=True)
class OtherJobDaemon:
    """A live daemon of the root on this machine that runs under another job id or runtime
    directory than the one asked about (found through the root's node locks)."""

    node: int
    job: str
    runtime_dir: str
    pid: int | None


def other_job_daemons(root: str | os.PathLike, config: CkptdConfig | None = None) -> list[OtherJobDaemon]:
    """The live daemons of ``root`` on this machine that :func:`local_daemons` does not reach: the
    job set ``CKPTD_JOB_ID`` or ``CKPTD_RUNTIME_DIR`` and this process did not. Named by the
    holders the root's node locks record (ckptd.daemon.rootlock), alive when their pid file is held."""
    from ..daemon.rootlock import recorded_holders

    config = config if config is not None else CkptdConfig.from_env()
    base = Endpoints.for_job(root, JobEnv(), config)
    host = socket.gethostname()
    found = []
    for node, holder in sorted(recorded_holders(base.root).items()):
        job, runtime_dir = holder.get("job"), holder.get("runtime_dir")
        if holder.get("host") != host or not isinstance(job, str) or not isinstance(runtime_dir, str):
            continue
        if not _JOB.match(job) or len(runtime_dir) > 4096 or (job, runtime_dir) == (base.job, str(base.runtime_dir)):
            continue
        pid_path = Path(runtime_dir) / f"{job}-n{node}.pid"
        if daemon_alive(pid_path):
            found.append(OtherJobDaemon(node=node, job=job, runtime_dir=runtime_dir, pid=daemon_pid(pid_path)))
    return found


def other_job_advice(root: str | os.PathLike, daemons: list[OtherJobDaemon], command: str) -> str:
    """What to run to reach the daemons of ``root`` that run under another job id or runtime
    directory: ``command`` (``ckptd ...``, with ``{job}`` where the job id goes) for each job."""
    jobs = list(dict.fromkeys((d.job, d.runtime_dir) for d in daemons))
    nodes = ", ".join(f"node {d.node} (pid {d.pid}, job {d.job})" for d in daemons)
    runs = "; ".join(f"CKPTD_RUNTIME_DIR={shlex.quote(r)} {command.format(job=j)}" for j, r in jobs)
    return f"no daemon of {root} runs on this machine under this shell's job id, but {nodes} do: {runs}"


def request(ep: Endpoints, config: CkptdConfig, msg: Message, reply_type: type[M], timeout_s: float) -> M:
    """Ask the daemon of ``ep`` one thing over its owner-only socket (ckptd.control.requests): its
    ``reply_type`` answer; its ERROR at once as RequestNotTaken (reason and code); a daemon that is
    not running as DaemonLostError at once; no answer within ``timeout_s`` as DaemonError."""
    codec = Codec(ep.job, config.max_message_nbytes)
    keys = derive_keys(load_token(ep, config))
    peer = f"the daemon of {ep.root} node {ep.node}"

    def check_alive() -> None:
        if not daemon_alive(ep.pid_path):
            raise DaemonLostError(f"{peer} is not running (no process holds {ep.pid_path}); see {ep.log_path}")

    ctx = zmq.Context()
    try:
        identity = f"admin-{os.getpid()}-{time.monotonic_ns()}".encode()
        sock = make_socket(ctx, zmq.DEALER, codec, keys, server=False, identity=identity)
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.connect(ep.ipc_address)
        hint = (
            f"see its log {ep.log_path}; a daemon busy beyond that, or started with another "
            "CKPTD_JOB_TOKEN (it refuses the handshake), does not answer"
        )
        client = RequestClient(Channel(sock, codec, "admin"), peer, hint, check_alive=check_alive)
        return client.request(msg, reply_type, timeout_s)
    finally:
        ctx.destroy(linger=0)


def daemon_status(d: LocalDaemon, config: CkptdConfig | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The daemon's STATUS reply: clients, rings, writes in flight, pending steps, metrics."""
    config = config if config is not None else CkptdConfig.from_env()
    return request(d.endpoints, config, Status(), StatusReply, timeout_s).info


def stop_bound_s(d: LocalDaemon, config: CkptdConfig) -> float:
    """How long the daemon may take to stop in order, and exit: the bound its STATUS reports, from
    its own settings (the job's, which may differ from this process's ``config``); from ``config``
    when it does not say."""
    try:
        bound = daemon_status(d, config).get("stop_bound_s")
    except (DaemonError, ProtocolError):
        bound = None
    if not isinstance(bound, (int, float)) or isinstance(bound, bool) or not 0 <= bound < 10**7:
        bound = config.daemon_stop_bound_s(mirror=bool(config.mirror))
    return float(bound) + STOP_EXIT_MARGIN_S


def stop_daemon(d: LocalDaemon, config: CkptdConfig | None = None, timeout_s: float | None = None) -> bool:
    """Ask the daemon to shut down in order (in-flight saves get ``shutdown_grace_s`` to commit)
    and wait until it is gone (``timeout_s``, by default :func:`stop_bound_s`); SIGTERM if it does
    not answer. True when it stopped in time."""
    config = config if config is not None else CkptdConfig.from_env()
    if timeout_s is None:
        timeout_s = stop_bound_s(d, config)
    try:
        request(d.endpoints, config, Shutdown(), ShutdownAck, min(timeout_s, 5.0))
    except DaemonError:  # not answered, or refused: ask as the signal does
        if d.pid is not None:
            try:
                os.kill(d.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    while daemon_alive(d.endpoints.pid_path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_all(root: str | os.PathLike, config: CkptdConfig | None = None, timeout_s: float | None = None) -> list[int]:
    """Stop every daemon of ``root``'s job on this machine; returns the nodes that did not stop."""
    return [d.node for d in local_daemons(root, config) if not stop_daemon(d, config, timeout_s)]
