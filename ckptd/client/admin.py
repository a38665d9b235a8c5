"""Talking to the node daemons of a checkpoint root from tools: find them, ask STATUS, stop them.

Used by ``ckptd status`` and ``ckptd daemon stop``; training code uses the Checkpointer instead.
Only daemons on this machine are reachable (their ``ipc://`` sockets live in the runtime dir).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, replace
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.channel import Endpoint, make_socket
from ..control.endpoints import Endpoints, JobEnv, load_token
from ..control.keys import derive_keys
from ..control.pidfile import daemon_alive, daemon_pid
from ..control.protocol import Codec, Shutdown, ShutdownAck, Status, StatusReply
from ..errors import DaemonError


@dataclass(frozen=True)
class LocalDaemon:
    node: int
    endpoints: Endpoints
    pid: int | None


def local_daemons(root: str | os.PathLike, config: CkptdConfig | None = None) -> list[LocalDaemon]:
    """The live daemons of ``root``'s job on this machine, by node id (a held pid-file lock = live)."""
    config = config if config is not None else CkptdConfig.from_env()
    base = Endpoints.for_job(root, JobEnv(), config)
    pattern = re.compile(rf"^{re.escape(base.job)}-n(\d+)\.pid$")
    found = []
    if base.runtime_dir.is_dir():
        for path in sorted(base.runtime_dir.iterdir()):
            m = pattern.match(path.name)
            if m and daemon_alive(path):
                ep = replace(base, node=int(m.group(1)))
                found.append(LocalDaemon(ep.node, ep, daemon_pid(path)))
    return sorted(found, key=lambda d: d.node)


def _request(ep: Endpoints, config: CkptdConfig, msg: Any, reply_type: type, timeout_s: float) -> Any:
    codec = Codec(ep.job, config.max_message_nbytes)
    keys = derive_keys(load_token(ep, config))
    ctx = zmq.Context()
    try:
        sock = make_socket(
            ctx, zmq.DEALER, codec, keys, server=False, identity=f"admin-{os.getpid()}-{time.monotonic_ns()}".encode()
        )
        sock.connect(ep.ipc_address)
        end = Endpoint(sock, codec, "admin")
        end.send(msg, block=False)
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if sock.poll(int(min(remaining, 0.1) * 1000), zmq.POLLIN):
                _, reply, _ = end.recv()
                if isinstance(reply, reply_type):
                    return reply
        raise DaemonError(
            f"the daemon of {ep.root} node {ep.node} did not answer {msg.TYPE.name} "
            f"within {timeout_s:.0f} s; see {ep.log_path}"
        )
    finally:
        ctx.destroy(linger=0)


def daemon_status(d: LocalDaemon, config: CkptdConfig | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """The daemon's STATUS reply: clients, pools, writes in flight, pending steps, metrics."""
    config = config if config is not None else CkptdConfig.from_env()
    return _request(d.endpoints, config, Status(), StatusReply, timeout_s).info


def stop_daemon(d: LocalDaemon, config: CkptdConfig | None = None, timeout_s: float = 60.0) -> bool:
    """Ask the daemon to shut down in order (in-flight saves get ``shutdown_grace_s`` to commit)
    and wait until it is gone; SIGTERM if it does not answer. True when it stopped in time."""
    config = config if config is not None else CkptdConfig.from_env()
    try:
        _request(d.endpoints, config, Shutdown(), ShutdownAck, min(timeout_s, 5.0))
    except DaemonError:
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


def stop_all(root: str | os.PathLike, config: CkptdConfig | None = None, timeout_s: float = 60.0) -> list[int]:
    """Stop every daemon of ``root``'s job on this machine; returns the nodes that did not stop."""
    return [d.node for d in local_daemons(root, config) if not stop_daemon(d, config, timeout_s)]
