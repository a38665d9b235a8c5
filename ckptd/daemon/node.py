"""The node daemon: one per job and node, serving its ranks and reporting to the coordinator.

Single-threaded around one event loop (ckptd.daemon.loop); what it is made of, each in its module:

- :class:`~ckptd.daemon.ranks.RankServer`: the ranks' ``ipc://`` socket, their HELLOs, rings
  (ckptd.daemon.rings) and liveness;
- :class:`~ckptd.daemon.intake.SaveIntake`: a SAVE in, the data file written from the ring by a
  writer thread (ckptd.daemon.workers), ``WRITE_DONE`` to the rank and ``WRITTEN``/``FAILED``
  upstream;
- :class:`~ckptd.daemon.uplink.CoordinatorLink`: the connection to the coordinator and the steps
  awaiting its verdict, which it forwards to their ranks (its decisions:
  ckptd.daemon.uplinkstate);
- on node 0, the :class:`~ckptd.daemon.coordinator.Coordinator` itself, on its own ``tcp://`` port
  (its decisions: ckptd.daemon.commitstate);
- the ZAP handler that admits only holders of the job's keys (ckptd.control.security).

Everything keeps working when the ranks die after their SAVE was acknowledged: the bytes are in
rings the daemon owns. Its files in the runtime directory (pid file, socket, token, log) are put
back when they vanish under it (ckptd.daemon.runfiles). The periodic chores of the loop's tick
never end the daemon: their errors are logged and counted (ckptd.daemon.guard); the Prometheus
endpoint runs on a thread of its own, bounded in connections and time (ckptd.daemon.metrics_http),
and only reads a copy of the status.
Stopping (a signal, ``SHUTDOWN``, or idleness of an auto-started daemon) lets work in flight
finish for ``shutdown_grace_s``, then aborts what is left; closing then waits for the worker threads
(``shutdown_grace_s`` again) and a mirror upload (``request_timeout_s``): ``stop_bound_s`` in
the status.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import secrets
import sys
import time
from typing import Any

import zmq

from ..config import CkptdConfig
from ..control.codec import Codec
from ..control.endpoints import Endpoints
from ..control.keys import CurveKeys
from ..control.protocol import Message, StepCommitted
from ..control.security import ZapHandler
from ..roots.base import RootStore
from ..roots.posix_root import PosixRoot
from .coordinator import Coordinator
from .guard import InternalErrors
from .intake import SaveIntake
from .loop import EventLoop
from .memory import MemoryWatch
from .metrics import DaemonMetrics, render_status
from .metrics_http import MetricsServer, http_url
from .nodelocal import NodeLocalCommits
from .ranks import DaemonHooks, RankServer
from .rings import RingTable
from .runfiles import RuntimeFiles
from .store import daemon_mirror
from .uplink import CoordinatorLink, StepKey
from .workers import (
    CommitFinished,
    Completion,
    Completions,
    NodeCommitFinished,
    RootChecked,
    WorkerPools,
    WriteFinished,
)

log = logging.getLogger(__name__)


# What `ckptd status` names as the log of a daemon started in the foreground (no log file).
_FOREGROUND_LOG = "its stderr (started in the foreground)"


class NodeDaemon:
    def __init__(
        self,
        ep: Endpoints,
        config: CkptdConfig,
        keys: CurveKeys,
        store: RootStore,
        *,
        coordinator: bool,
        exit_when_idle: bool,
        runfiles: RuntimeFiles,
        adopt: list[StepKey] | None = None,
        nnodes: int = 1,
    ) -> None:
        self.ep = ep
        self.runfiles = runfiles
        self.store = store
        self.config = config
        self.instance = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.exit_when_idle = exit_when_idle
        self.idle_since_s: float | None = time.monotonic()
        self.stopping_since: float | None = None
        self.stop_reason = ""
        self.stuck = False  # closing left a worker thread running (see close)
        self.last_check_s = 0.0
        self.metrics, self.memory, self.completions = DaemonMetrics(), MemoryWatch(), Completions()
        self.internal = InternalErrors()
        self.workers = WorkerPools(config.writer_threads, self.completions)
        self.rings = RingTable(ep.shm_prefix)
        codec = Codec(ep.job, config.max_message_nbytes)
        self.ctx = zmq.Context()
        self.zap = ZapHandler(self.ctx, keys)  # first: no server socket accepts a client without it
        self.coordinator = (
            Coordinator(
                self.ctx,
                codec,
                keys,
                ep.coordinator_bind,
                store,
                config,
                self.workers,
                self.instance,
                adopt or [],
                internal=self.internal,
                node=ep.node,
            )
            if coordinator
            else None
        )
        # Node 0 copies committed steps to the mirror; on a node-local root every node uploads its own files.
        self.mirror = (
            daemon_mirror(ep.root, config, node=ep.node, nnodes=nnodes) if coordinator or config.node_local else None
        )
        self.node_local = (
            NodeLocalCommits(store, self.workers)
            if config.node_local and not coordinator and isinstance(store, PosixRoot)
            else None
        )
        upstream = self.coordinator.address if self.coordinator is not None else ep.coordinator_connect
        self.uplink = CoordinatorLink(
            self.ctx,
            codec,
            keys,
            upstream,
            ep.node,
            f"node{ep.node}-{self.instance}".encode(),
            config,
            self._deliver,
            store=store,
            workers=self.workers,
            internal=self.internal,
            node_local=self.node_local,
        )
        self.intake = SaveIntake(
            ep,
            config,
            self.rings,
            self.workers,
            self.metrics,
            self.uplink,
            store,
            lambda msg, identity: self.ranks.send(msg, identity),
            internal=self.internal,
        )
        hooks = DaemonHooks(
            self.instance, self._status_now, self.request_stop, self._stopping, self._follow_coordinator
        )
        self.ranks = RankServer(self.ctx, codec, keys, ep, self.rings, self.intake, self.uplink, hooks)
        runfiles.watch_socket(self.ranks.rebind)
        self.loop = EventLoop()
        self.loop.add(self.zap.sock, self.zap.on_readable)
        self.loop.add(self.ranks.watch.sock, self.ranks.watch.on_readable)
        if self.coordinator is not None:
            self.loop.add(self.coordinator.watch.sock, self.coordinator.watch.on_readable)
        self.loop.add(self.ranks.channel.sock, self.ranks.on_readable)
        self.loop.add(self.uplink.channel.sock, self.uplink.on_readable)
        if self.coordinator is not None:
            self.loop.add(self.coordinator.channel.sock, self.coordinator.on_readable)
        self.loop.add(self.completions.fd, self._on_completions)
        log.info(
            "daemon %s for %s node %d: ranks on %s, coordinator %s",
            self.instance,
            ep.root,
            ep.node,
            ep.ipc_address,
            upstream,
        )
        self.status_cache: dict[str, Any] = {}
        self.metrics_server: MetricsServer | None = None
        self.metrics_problem: str | None = None  # why metrics are not served, when asked for
        if config.metrics_port:
            self._serve_metrics(config.metrics_host, config.metrics_port)

    def _serve_metrics(self, host: str, port: int) -> None:
        # The HTTP thread reads only this cache, which the loop replaces: no shared state.
        self.status_cache = self.status()
        url = http_url(host, port)
        try:
            self.metrics_server = MetricsServer.bind(host, port, lambda: self.status_cache, render_status)
        except OSError as exc:  # metrics are optional: never fail the checkpoints for them
            taken = exc.errno == errno.EADDRINUSE
            self.metrics_problem = (
                f"could not bind {url}: {exc.strerror or exc}"
                + (
                    f"; another process listens there (`ss -ltnp 'sport = :{port}'` names it), so "
                    "whatever answers there is not this daemon"
                    if taken
                    else ""
                )
                + "; checkpoints are unaffected, restart the daemon with a free CKPTD_METRICS_PORT"
            )
            log.warning("metrics NOT served: %s", self.metrics_problem)
            return
        self.metrics_server.start()
        log.info("serving Prometheus metrics on %s", self.metrics_server.url)

    def _metrics_status(self) -> dict[str, Any] | None:
        if self.metrics_server is not None:
            return self.metrics_server.status()
        if self.metrics_problem is not None:
            url = http_url(self.config.metrics_host, self.config.metrics_port)
            return {"url": url, "serving": False, "problem": self.metrics_problem}
        return None

    # --- loop ---------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            self.stop_reason = reason
            log.info("daemon stopping: %s", reason)

    def _stopping(self) -> str | None:
        return None if self.stopping_since is None else self.stop_reason

    def wake(self) -> None:
        """Async-signal-safe: make the loop return from its poll (used by signal handlers)."""
        self.completions.post_signal()

    def run(self) -> None:
        tick_ms = max(10, int(min(self.config.heartbeat_s, 0.25) * 1000))
        if self.mirror is not None:
            self.mirror.start()
        while True:
            self.loop.poll(tick_ms)
            if self.completions.signalled():
                self.request_stop("signal")
            now = time.monotonic()
            self._tick(now)
            if self._should_exit(now):
                return

    def _on_completions(self) -> None:
        # One completion's handling failing must neither end the daemon nor lose the others drained
        # with it: logged and counted as an internal error (ckptd.daemon.guard).
        for done in self.completions.drain():
            self.internal.run(f"handling of a finished {type(done).__name__}", functools.partial(self._on_done, done))

    def _on_done(self, done: Completion) -> None:
        self.workers.finished()
        if isinstance(done, WriteFinished):
            self.intake.on_done(done)
        elif isinstance(done, RootChecked):
            self.uplink.on_root_checked(done)
        elif isinstance(done, NodeCommitFinished):
            if self.node_local is not None:
                self.uplink.verdict_in(self.node_local.done(done))
                if self.mirror is not None and done.error is None:
                    self.mirror.kick()  # this node's files of the step are under their final name now
        elif self.coordinator is not None:  # commits and cleanups are the coordinator's (a node-local
            # root's cleanups on other nodes need nothing more)
            self.coordinator.on_done(done)
            if self.mirror is not None and isinstance(done, CommitFinished) and done.error is None:
                self.mirror.kick()

    def _deliver(self, key: StepKey, identities: set[bytes], outcome: Message) -> None:
        """A step resolved: count it and tell its ranks."""
        self.metrics.resolved(key[0], committed=isinstance(outcome, StepCommitted))
        for identity in identities:  # each on its own: one rank's failed send must not cost the others theirs
            self.internal.run("delivery of a verdict", functools.partial(self.ranks.send, outcome, identity))

    def _tick(self, now: float) -> None:
        """The periodic chores; each one's error is logged and counted, never fatal (see
        ckptd.daemon.guard), and the others still run."""
        chore = self.internal.run
        if self.coordinator is not None:
            coordinator = self.coordinator
            chore("coordinator's timeouts", lambda: coordinator.tick(now))
        chore("write timeouts", lambda: self.intake.tick(now))
        chore("coordinator link's heartbeat", lambda: self.uplink.tick(now))
        if now - self.last_check_s >= self.config.heartbeat_s:
            self.last_check_s = now
            chore("rank liveness check", self.ranks.forget_dead)
            chore("memory sample", self._sample_memory)
            chore("runtime files check", self.runfiles.check)
        if self.metrics_server is not None:
            chore("status for the metrics", self._refresh_status_cache)

    def _sample_memory(self) -> None:
        self.memory.sample([(c.rank, c.pid) for c in self.ranks.clients.values()], self.rings.segment_paths())

    def _status_now(self) -> dict[str, Any]:
        """What a STATUS request gets: memory sampled now, not up to ``heartbeat_s`` ago (a save
        that commits within a heartbeat of the ring's first pages is otherwise reported with
        none of them)."""
        self.internal.run("memory sample", self._sample_memory)
        return self.status()

    def _refresh_status_cache(self) -> None:
        self.status_cache = self.status()

    def _busy(self) -> bool:
        return bool(
            self.workers.in_flight
            or self.uplink.busy
            or (self.coordinator is not None and self.coordinator.busy)
            or (self.mirror is not None and self.mirror.busy)
        )

    def _should_exit(self, now: float) -> bool:
        if self.stopping_since is not None:
            if not self._busy():
                return True
            if now - self.stopping_since > self.config.shutdown_grace_s:
                log.warning(
                    "shutdown grace of %.0f s over with work in flight; aborting it", self.config.shutdown_grace_s
                )
                # Only this node gives up: the coordinator may still commit what was reported, so
                # the ranks are told the outcome is unknown, not that nothing was committed.
                self.uplink.abort_pending(
                    "the node daemon shut down before the coordinator's verdict arrived; the step may "
                    "still have committed (a resume loads it if it did: check with ckptd ls)"
                )
                return True
            return False
        if not self.exit_when_idle:
            return False
        # Until a first rank connects, the rank that launched us may still be starting up.
        cfg = self.config
        idle_exit_s = cfg.idle_exit_s if self.ranks.served_a_rank else max(cfg.idle_exit_s, cfg.daemon_start_timeout_s)
        if self.ranks.clients or self._busy():
            self.idle_since_s = None
        elif self.idle_since_s is None:
            self.idle_since_s = now
        elif now - self.idle_since_s >= idle_exit_s:
            self.request_stop(f"idle for {idle_exit_s:.0f} s with no ranks connected")
            return True
        return False

    def close(self) -> None:
        """Orderly cleanup: stop workers, unlink every segment this daemon owns, close sockets.
        Every step runs, whatever an earlier one raises (the first error is raised at the end):
        above all the workers' shutdown, which tells whether one is stuck (``stuck``)."""
        with contextlib.ExitStack() as steps:  # last in, first run
            steps.callback(self.completions.close)
            steps.callback(self.ctx.term)
            steps.callback(self.zap.close)
            if self.coordinator is not None:
                steps.callback(self.coordinator.close)
            steps.callback(self.uplink.close)
            steps.callback(self.ranks.close)
            steps.callback(lambda: self.rings.release_all(unmap=not self.stuck))
            steps.callback(self._on_completions)
            steps.callback(self._stop_workers)
            if self.mirror is not None:
                steps.callback(self._stop_mirror)
            if self.metrics_server is not None:
                steps.callback(self.metrics_server.close)

    def _stop_mirror(self) -> None:
        if self.mirror is not None and not self.mirror.stop(self.config.request_timeout_s):
            self.stuck = True  # an upload stuck in the store: see _stop_workers

    def _stop_workers(self) -> None:
        # A write or commit stuck in storage (a hung NFS mount, an S3 call) must not keep the daemon,
        # its locks and its socket forever: it is left behind, and the process exits without it.
        if not self.workers.shutdown(self.config.shutdown_grace_s):
            self.stuck = True
            log.error(
                "a writer or commit thread did not stop within %.0f s (storage not answering?); the "
                "daemon exits without it, and the staging rings' names are removed",
                self.config.shutdown_grace_s,
            )

    def _follow_coordinator(self, address: str, newest: bool) -> None:
        """A rank's HELLO says its launch has the coordinator at ``address``. This daemon may have
        been started by an earlier launch with another MASTER_ADDR/MASTER_PORT (it outlives its
        ranks), while node daemons the new launch started use the new address: node 0's
        coordinator listens there too, another node's link connects there instead (a coordinator
        it finds restarted is handled as any restart: ckptd.daemon.uplinkstate). Node 0's
        coordinator listens on every launch's address (that only adds one); another node follows
        only the ``newest`` launch's (ckptd.daemon.ranks: never back to an older one). Ranks take
        the coordinator for node 0's: a daemon told to run it elsewhere (``ckptd daemon
        --coordinator``/``--no-coordinator``) keeps the addresses it was given."""
        if (self.coordinator is not None) != (self.ep.node == 0):
            return
        if self.coordinator is not None:
            self.coordinator.listen(address)
        elif newest and address != self.uplink.address:
            self.uplink.retarget(address)

    def status(self) -> dict[str, Any]:
        rejected = self.ranks.rejected()
        rejected["malformed"] += self.uplink.channel.rejected
        coordinator = self.coordinator.status() if self.coordinator is not None else None
        return {
            "instance": self.instance,
            "pid": os.getpid(),
            "node": self.ep.node,
            "root": str(self.ep.root),
            "job": self.ep.job,
            # Where it logs: its log file when detached, else the stderr it was started with.
            "log": str(self.ep.log_path) if self.runfiles.log_id is not None else _FOREGROUND_LOG,
            "clients": [{"rank": c.rank, "pid": c.pid} for c in self.ranks.clients.values()],
            "rings": self.rings.summary(),
            "jobs_in_flight": self.workers.in_flight,
            "pending_steps": self.uplink.pending_steps(),
            "upstream": self.uplink.status(),
            # Every rejection of this daemon, its coordinator's port included (ckptd_rejected_messages_total).
            "rejected_messages": sum(rejected.values()) + (coordinator["rejected_messages"] if coordinator else 0),
            "rejected": rejected,
            "coordinator": coordinator,
            "mirror": self.mirror.status() if self.mirror is not None else None,
            "stopping": self.stopping_since is not None,
            # What `ckptd daemon stop` waits for (with this daemon's settings, not the shell's).
            "stop_bound_s": self.config.daemon_stop_bound_s(mirror=self.mirror is not None),
            "metrics": self.metrics.snapshot(),
            "memory": self.memory.report(),
            # The daemon saves and commits without torch (README: Daemon memory); True once
            # something imported it (a mirror's upload, a crash recovery's check, a bug).
            "torch_imported": "torch" in sys.modules,
            "prometheus": self._metrics_status(),  # where metrics are served, or why they are not
            "internal_errors": self._internal_errors(),
        }

    def _internal_errors(self) -> dict[str, Any]:
        """Housekeeping errors, and the metrics server's (see ckptd.daemon.guard)."""
        out = self.internal.status()
        if self.metrics_server is not None and self.metrics_server.counts["errors"]:
            out["by_chore"]["metrics server"] = self.metrics_server.counts["errors"]
            out["count"] += self.metrics_server.counts["errors"]
            out["last"] = out["last"] or f"metrics server: {self.metrics_server.last_error}"
        return out
