"""A rank's connection to its node daemon: auto-start, handshake, requests with timeouts, liveness.

Order of use (by the Checkpointer, on the training thread only; not thread-safe):

1. :meth:`DaemonLink.connect`: if no daemon holds the job's pid-file lock, local rank 0 launches
   ``ckptd daemon --detach`` and every rank waits (``daemon_start_timeout_s``) for one; then the
   ``HELLO`` -> ``WELCOME`` handshake over CurveZMQ with the job's keys (protocol version, daemon
   instance; the daemon checks the HELLO's pid against the socket's credentials);
2. :meth:`request`: send one request and wait for its reply; notifications arriving meanwhile
   (``WRITE_DONE``, ``STEP_COMMITTED``, ``STEP_ABORTED``) go to the ``on_notify`` callback;
3. :meth:`pump`: deliver notifications without a request (``handle.done()``/``wait()``);
4. every wait polls in short intervals and checks that the daemon process it handshook with
   still runs (its pid and start time: ckptd.procid): a dead daemon raises
   :class:`DaemonLostError` at once instead of a timeout. Not its pid file: one removed under a
   live daemon (its runtime directory deleted at a logout or by a ``/tmp`` cleaner; the daemon
   puts it back, ckptd.daemon.runfiles) must not make a working connection look dead.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import zmq

from ..config import CkptdConfig
from ..control.channel import Channel, make_socket
from ..control.codec import Codec
from ..control.endpoints import Endpoints, JobEnv, load_token
from ..control.keys import CurveKeys, derive_keys
from ..control.pidfile import daemon_alive, daemon_pid
from ..control.protocol import Bye, Hello, Message, Save, SaveAck, Skip, Welcome
from ..control.requests import RequestClient
from ..errors import CkptdError, DaemonError, DaemonLostError, RequestNotTaken
from ..procid import same_process, start_ticks_of

__all__ = ["DaemonLink", "DaemonLostError", "RequestNotTaken"]

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

# How long a dropped link's BYE may take to leave before its socket goes (ckptd.client.link.abandon).
_ABANDON_LINGER_MS = 200


class DaemonLink:
    def __init__(
        self,
        ep: Endpoints,
        env: JobEnv,
        config: CkptdConfig,
        codec: Codec,
        keys: CurveKeys,
        on_notify: Callable[[Message], None],
    ) -> None:
        self.ep = ep
        self.env = env
        self.config = config
        self.codec = codec
        self.keys = keys
        self.on_notify = on_notify
        self.ctx = zmq.Context()
        self.channel: Channel | None = None
        self.requests: RequestClient | None = None
        self.instance: str | None = None
        self.daemon_pid: int | None = None
        self.daemon_start_ticks: int | None = None  # its process's start (None: /proc does not show it)
        # Why a request found the daemon gone and closed the socket ('' since the last connect):
        # the session drops that daemon's ring and saves with it (ckptd.client.session).
        self.lost = ""

    @classmethod
    def for_job(
        cls, ep: Endpoints, env: JobEnv, config: CkptdConfig, on_notify: Callable[[Message], None]
    ) -> DaemonLink:
        """A link (not connected yet) authenticated with the job's keys (ckptd.control.keys)."""
        if env.nnodes > 1 and not config.job_token and env.master_addr not in ("127.0.0.1", "localhost", "::1"):
            raise CkptdError(
                "a job spanning machines needs a shared secret: set CKPTD_JOB_TOKEN to the same "
                "random string on every node (every socket's CurveZMQ keys are derived from it)"
            )
        keys = derive_keys(load_token(ep, config))
        return cls(ep, env, config, Codec(ep.job, config.max_message_nbytes), keys, on_notify)

    @property
    def connected(self) -> bool:
        return self.channel is not None

    # --- connecting ------------------------------------------------------------------------
    def connect(self) -> Welcome:
        """Ensure a daemon runs (starting it on local rank 0) and complete the handshake. A daemon
        that exits during the handshake (an auto-started one going idle just then) is replaced,
        until ``daemon_start_timeout_s``."""
        deadline = time.monotonic() + self.config.daemon_start_timeout_s
        while True:
            try:
                return self._connect_once(deadline)
            except DaemonLostError:
                if time.monotonic() > deadline:
                    raise
                log.info("rank %d: the node daemon exited during the handshake; connecting again", self.env.rank)

    def _connect_once(self, deadline: float) -> Welcome:
        while not daemon_alive(self.ep.pid_path):
            if self.env.local_rank == 0:
                # _launch returns once a daemon served; if none is alive now it exited again
                # (e.g. idle, or crashed), so launching again is right until the deadline.
                self._launch(deadline)
                if time.monotonic() > deadline:
                    break
                continue
            if time.monotonic() > deadline:
                raise DaemonError(
                    f"no ckptd daemon for {self.ep.root} node {self.ep.node} appeared within "
                    f"{self.config.daemon_start_timeout_s:.0f} s (local rank 0 starts it; see "
                    f"{self.ep.log_path})"
                )
            time.sleep(0.05)
        self._open_socket()
        # Forget the previous daemon's pid: while it is set, a slow WELCOME from its successor
        # would make alive() report the new daemon as dead.
        self.daemon_pid = self.daemon_start_ticks = None
        welcome = self._hello()
        self.instance = welcome.instance
        self.daemon_pid = welcome.pid
        self.daemon_start_ticks = start_ticks_of(welcome.pid)
        log.info("rank %d connected to daemon %s (pid %d)", self.env.rank, welcome.instance, welcome.pid)
        return welcome

    def _hello(self) -> Welcome:
        hello = Hello(
            rank=self.env.rank, pid=os.getpid(), root=str(self.ep.root), coordinator=self.ep.launch_coordinator
        )
        return self.request(hello, Welcome)

    def hello_again(self) -> None:
        """Say HELLO again on this connection, after the daemon refused a request as from an
        unknown client (it took this rank for gone). The connection, and so the routing of the
        outcomes of saves in flight, stays; the caller registers a new staging ring."""
        welcome = self._hello()
        if welcome.instance != self.instance:
            self.close_socket()
            self.lost = (
                f"the node daemon of {self.ep.root} node {self.ep.node} was replaced "
                f"({self.instance} -> {welcome.instance}); see {self.ep.log_path}"
            )
            raise DaemonLostError(self.lost)
        log.warning(
            "rank %d: said HELLO again to daemon %s, which had forgotten this rank", self.env.rank, self.instance
        )

    def _launch(self, deadline: float) -> None:
        cmd = [
            sys.executable,
            "-m",
            "ckptd.cli",
            "daemon",
            "--detach",
            "--exit-when-idle",
            "--root",
            str(self.ep.root),
            "--job",
            self.ep.job,
            "--node",
            str(self.ep.node),
            "--nnodes",
            str(self.env.nnodes),
            "--coordinator-connect",
            self.ep.coordinator_connect,
            "--coordinator-bind",
            self.ep.coordinator_bind,
        ]
        env = {**os.environ, **self.config.to_env()}
        env["CKPTD_JOB_ID"] = self.ep.job
        env["CUDA_VISIBLE_DEVICES"] = ""  # the daemon never uses a GPU (ckptd.commands.daemon)
        log.info("rank %d: starting the node daemon: %s", self.env.rank, " ".join(cmd))
        try:
            proc = subprocess.run(
                cmd,
                check=False,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=max(1.0, deadline - time.monotonic()),
                close_fds=True,
            )
        except subprocess.TimeoutExpired:
            raise DaemonError(f"starting the ckptd daemon timed out; see {self.ep.log_path}") from None
        if proc.returncode != 0:
            raise DaemonError(f"the ckptd daemon did not start (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")

    def _open_socket(self) -> None:
        self.close_socket()
        self.lost = ""
        ident = f"r{self.env.rank}-{os.getpid()}-{time.monotonic_ns() % 10**9}".encode()
        sock = make_socket(self.ctx, zmq.DEALER, self.codec, self.keys, server=False, identity=ident)
        sock.setsockopt(zmq.SNDTIMEO, int(self.config.request_timeout_s * 1000))
        sock.connect(self.ep.ipc_address)
        self.channel = Channel(sock, self.codec, f"rank{self.env.rank}")
        self.requests = RequestClient(
            self.channel,
            f"the node daemon of {self.ep.root} node {self.ep.node}",
            f"see {self.ep.log_path} (a daemon started with another CKPTD_JOB_TOKEN refuses this "
            "rank's handshake; CKPTD_REQUEST_TIMEOUT_S bounds the wait)",
            on_other=self.on_notify,
            check_alive=self._check_alive,
        )

    def close_socket(self, linger_ms: int = 0) -> None:
        if self.channel is not None:
            self.channel.sock.close(linger=linger_ms)
            self.channel = None
            self.requests = None

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` lets a last message (BYE) leave first. Idempotent."""
        self.close_socket(linger_ms)
        if not self.ctx.closed:
            self.ctx.term()  # returns once the socket is gone: it was closed just above

    def abandon(self) -> None:
        """The owner was dropped without closing (a weakref finalizer calls this, possibly inside
        a garbage collection): say BYE without waiting, so the daemon releases the ring, and close
        within a bounded linger. Never blocks longer than that, never raises."""
        if self.ctx.closed:
            return
        try:
            if self.channel is not None:
                self.channel.send(Bye(), block=False)
        except Exception:  # noqa: BLE001 - a finalizer must not fail; the daemon notices the exit anyway
            pass
        self.close(linger_ms=_ABANDON_LINGER_MS)

    # --- talking -------------------------------------------------------------------------------
    def alive(self) -> bool:
        """The daemon we handshook with still runs: its process (pid and start time), whatever
        became of its pid file. Before the handshake, or where /proc does not show the daemon's
        process: a daemon holds the pid file's lock, and it is the one we handshook with."""
        if self.daemon_pid is not None and self.daemon_start_ticks is not None:
            return same_process(self.daemon_pid, self.daemon_start_ticks)
        if not daemon_alive(self.ep.pid_path):
            return False
        pid = daemon_pid(self.ep.pid_path)
        return self.daemon_pid is None or pid is None or pid == self.daemon_pid

    def send(self, msg: Message) -> None:
        self._requests().send(msg)

    def announce(self, msg: Save | Skip) -> None:
        """Send a SAVE or SKIP and wait for its SAVE_ACK (the one of its step and attempt)."""
        self.request(msg, SaveAck, match=lambda a: a.step == msg.step and a.attempt == msg.attempt)

    def request(
        self,
        msg: Message,
        reply_type: type[M],
        timeout_s: float | None = None,
        match: Callable[[M], bool] | None = None,
    ) -> M:
        """Send ``msg``, wait for a ``reply_type`` answer (one ``match`` accepts, when given: a late
        answer to an earlier request is not taken for this one's); notifications meanwhile go to
        ``on_notify``; ``ERROR`` raises RequestNotTaken (ckptd.control.requests)."""
        timeout_s = self.config.request_timeout_s if timeout_s is None else timeout_s
        return self._requests().request(msg, reply_type, timeout_s, match)

    def pump(self, timeout_s: float = 0.0) -> None:
        """Wait up to ``timeout_s`` for a notification, then deliver all that are here."""
        requests = self._requests()
        msg = requests.next(time.monotonic() + timeout_s)
        while msg is not None:
            self.on_notify(msg)
            msg = requests.next(0.0)

    def _requests(self) -> RequestClient:
        if self.requests is None:
            raise DaemonLostError("not connected to the node daemon")
        return self.requests

    def _check_alive(self) -> None:
        if not self.alive():
            self.close_socket()
            self.lost = (
                f"the node daemon (pid {self.daemon_pid}) of {self.ep.root} node {self.ep.node} died; "
                f"see {self.ep.log_path}"
            )
            raise DaemonLostError(self.lost)


def weakly(method: Callable[..., None]) -> Callable[..., None]:
    """``method`` called through a weak reference to its object (a no-op once it is gone): what a
    Checkpointer hands the objects it owns (its link, its tries, an optimizer's hook), so that one
    dropped without close() is freed at once rather than by the cyclic collector."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def abandon_dropped(link: DaemonLink, rank: int) -> None:
    """A Checkpointer was garbage-collected without close(): release its connection, never block."""
    log.warning(
        "rank %d: a Checkpointer was dropped without close(); its connection is closed now. Saves "
        "already handed to the daemon still commit, but nobody learns their outcome: call close() "
        "or use `with ckptd.Checkpointer(...) as ckpt:`",
        rank,
    )
    link.abandon()
