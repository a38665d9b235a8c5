"""The node daemon: one per job and node, serving its ranks and reporting to the coordinator.

Single-threaded around a zmq poller (ranks' ``ipc://`` ROUTER, the upstream DEALER to the
coordinator, the coordinator's ROUTER on node 0, their ZAP handler and handshake monitors, and the
completion pipe of the worker threads). Every socket runs CurveZMQ with keys derived from the job
token (ckptd.control.keys). What it does per save, in order (see :mod:`ckptd.control.protocol`):

1. ``SAVE`` from a rank: check that the connection is the rank's (its HELLO, checked against the
   kernel's credentials of the socket) and owns the pool, the slot, the records and the snapshot
   child, mark the slot busy, queue the write into ``<step>.<attempt>.tmp/``, answer ``SAVE_ACK``
   (the daemon now owns the bytes);
2. a writer thread writes ``__<rank>_0.distcp`` from the slot (zero-copy views) and fsyncs it;
3. back in the loop: ``SLOT_FREE`` to the rank, ``WRITTEN`` (or ``FAILED``) to the coordinator;
4. ``STEP_COMMITTED`` / ``STEP_ABORTED`` from the coordinator is forwarded to the ranks of that
   step and attempt.

Everything keeps working when the ranks die after step 1: the bytes are in segments the daemon
owns. Liveness: ranks' pids are checked every heartbeat (a dead rank's pool is released when its
writes finish); the coordinator is pinged every heartbeat, also while idle (so that the first
report after a coordinator restart is not taken for one its predecessor lost), and a silent or
restarted coordinator aborts the steps awaiting it with the reason. A write that finishes after its
attempt was decided is reported as FAILED, never WRITTEN.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any, NamedTuple

import psutil
import zmq

from ..config import CkptdConfig
from ..control.channel import Endpoint, link_timeout_s, make_socket, peer_pid, peer_uid, replace_dead_links
from ..control.endpoints import Endpoints
from ..control.keys import CurveKeys
from ..control.protocol import (
    Bye,
    Codec,
    ErrorReply,
    Failed,
    Hello,
    Message,
    Ping,
    PoolOk,
    Pong,
    RegisterPool,
    Save,
    SaveAck,
    Shutdown,
    ShutdownAck,
    Skip,
    SlotFree,
    Status,
    StatusReply,
    StepAborted,
    StepCommitted,
    Welcome,
    Written,
)
from ..control.security import HandshakeWatch, ZapHandler
from ..errors import CkptdError, ProtocolError, StagingError
from ..format.direct import open_data_file
from ..format.records import ItemRecord
from ..staging.pool import Placement
from .commit import tmp_dir
from .coordinator import Coordinator
from .metrics import DaemonMetrics, serve_metrics
from .pools import PoolTable
from .snapshot import SnapshotWait, check_snapshot_child
from .faults import debug_opener
from .workers import Completions, Done, WorkerPools, WriteRequest, write_rank_file

log = logging.getLogger(__name__)


@dataclass
class Client:
    rank: int
    pid: int
    create_time: float | None


StepKey = tuple[int, str]  # (step, attempt)


class WriteKey(NamedTuple):
    """A queued write, as the loop needs it back when the write finished (``Done.key``)."""

    step: int
    attempt: str
    rank: int
    world_size: int
    generation: str
    slot: int
    identity: bytes
    common: bytes | None
    common_digest: str
    nbytes: int

    def __repr__(self) -> str:  # logged when a write fails: never the common state's bytes
        return f"step {self.step} attempt {self.attempt} rank {self.rank}"


@dataclass
class PendingStep:
    """An attempt of a step this node wrote for, awaiting the coordinator's verdict."""

    notify: set[bytes] = field(default_factory=set)  # rank identities to tell the outcome
    sent_to: str | None = None  # coordinator instance known when WRITTEN/FAILED went out
    waiting_since: float | None = None  # when the first report went upstream
    reports: list[Message] = field(default_factory=list)  # WRITTEN/FAILED sent upstream (resent after a gap)


class NodeDaemon:
    def __init__(self, ep: Endpoints, config: CkptdConfig, keys: CurveKeys, *, coordinator: bool,
                 exit_when_idle: bool, adopt: list[StepKey] = ()) -> None:  # type: ignore[assignment]
        self.ep = ep
        self.config = config
        self.instance = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.exit_when_idle = exit_when_idle
        self.codec = Codec(ep.job, config.max_message_nbytes)
        self.ctx = zmq.Context()
        self.zap = ZapHandler(self.ctx, keys)  # first: no server socket accepts a client without it
        self.completions = Completions()
        self.metrics = DaemonMetrics()
        self.metrics_server: ThreadingHTTPServer | None = None
        self.status_cache: dict[str, Any] = {}
        self.workers = WorkerPools(config.writer_threads, self.completions)
        self.pools = PoolTable(ep.shm_prefix)
        self.opener = debug_opener(config.debug_write_delay_s, config.debug_fault_file, open_data_file)
        self.clients: dict[bytes, Client] = {}
        self.steps: dict[StepKey, PendingStep] = defaultdict(PendingStep)
        self.outbox: list[tuple[float, Message, StepKey]] = []  # (first try, message, attempt)
        # FAILED reports of steps aborted here because the coordinator vanished: a restarted
        # coordinator learns them (and removes the step's tmp dir) once it is reachable.
        self.late: list[tuple[float, Message]] = []
        self.coordinator: Coordinator | None = None
        self.coordinator_instance: str | None = None
        self.last_pong_s = time.monotonic()
        self.link_timeout_s = link_timeout_s(config.heartbeat_s, config.coordinator_timeout_s)
        self.last_ping_s = 0.0
        self.last_check_s = 0.0
        self.idle_since_s: float | None = time.monotonic()
        self.served_a_rank = False
        self.stopping_since: float | None = None
        self.stop_reason = ""

        old_umask = os.umask(0o077)
        try:
            ep.socket_path.unlink(missing_ok=True)
            sock = make_socket(self.ctx, zmq.ROUTER, self.codec, keys, server=True)
            self.ranks_watch = HandshakeWatch(sock, "daemon")
            self.ranks = Endpoint(sock, self.codec, "daemon")
            self.ranks.sock.bind(ep.ipc_address)
        finally:
            os.umask(old_umask)
        upstream_addr = ep.coordinator_connect
        if coordinator:
            self.coordinator = Coordinator(self.ctx, self.codec, keys, ep.coordinator_bind, ep.root, config,
                                           self.workers, self.instance, adopt)
            upstream_addr = self.coordinator.address
        up = make_socket(self.ctx, zmq.DEALER, self.codec, keys, server=False,
                         identity=f"node{ep.node}-{self.instance}".encode())
        up.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a coordinator we are not connected to
        replace_dead_links(up, config.heartbeat_s, self.link_timeout_s)
        if upstream_addr.startswith("tcp://[") or upstream_addr.count(":") > 2:
            up.setsockopt(zmq.IPV6, 1)
        up.connect(upstream_addr)
        self.upstream = Endpoint(up, self.codec, "upstream")
        self.poller = zmq.Poller()
        self.poller.register(self.ranks.sock, zmq.POLLIN)
        self.poller.register(self.upstream.sock, zmq.POLLIN)
        self.poller.register(self.zap.sock, zmq.POLLIN)
        self.poller.register(self.ranks_watch.sock, zmq.POLLIN)
        if self.coordinator is not None:
            self.poller.register(self.coordinator.ep.sock, zmq.POLLIN)
            self.poller.register(self.coordinator.watch.sock, zmq.POLLIN)
        self.poller.register(self.completions.fd, zmq.POLLIN)
        log.info("daemon %s for %s node %d: ranks on %s, coordinator %s", self.instance, ep.root,
                 ep.node, ep.ipc_address, upstream_addr)
        if config.metrics_port:
            # The HTTP thread reads only this cache, which the loop refreshes: no shared state.
            self.status_cache = self.status()
            try:
                self.metrics_server = serve_metrics(config.metrics_port, lambda: self.status_cache)
                log.info("serving Prometheus metrics on http://127.0.0.1:%d/metrics", config.metrics_port)
            except OSError as exc:  # metrics are optional: never fail the checkpoints for them
                log.warning("cannot serve metrics on port %d (%s); CKPTD_METRICS_PORT ignored",
                            config.metrics_port, exc)

    # --- loop -----------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
            self.stop_reason = reason
            log.info("daemon stopping: %s", reason)

    def wake(self) -> None:
        """Async-signal-safe: make the poller return (used by signal handlers)."""
        self.completions.post_signal()

    def run(self) -> None:
        tick_ms = max(10, int(min(self.config.heartbeat_s, 0.25) * 1000))
        while True:
            events = dict(self.poller.poll(tick_ms))
            if self.zap.sock in events:
                self.zap.on_readable()
            if self.ranks_watch.sock in events:
                self.ranks_watch.on_readable()
            if self.coordinator is not None and self.coordinator.watch.sock in events:
                self.coordinator.watch.on_readable()
            if self.ranks.sock in events:
                self._drain_ranks()
            if self.upstream.sock in events:
                self._drain_upstream()
            if self.coordinator is not None and self.coordinator.ep.sock in events:
                self.coordinator.on_readable()
            if self.completions.fd in events:
                for done in self.completions.drain():
                    self._on_done(done)
            if self.completions.signalled():
                self.request_stop("signal")
            now = time.monotonic()
            self._tick(now)
            if self._should_exit(now):
                return

    def _busy(self) -> bool:
        return bool(self.workers.in_flight or self.steps or self.outbox
                    or (self.coordinator is not None and self.coordinator.busy))

    def _should_exit(self, now: float) -> bool:
        if self.stopping_since is not None:
            if not self._busy():
                return True
            if now - self.stopping_since > self.config.shutdown_grace_s:
                log.warning("shutdown grace of %.0f s over with work in flight; aborting it",
                            self.config.shutdown_grace_s)
                self._abort_pending("the node daemon shut down before the step committed")
                return True
            return False
        if self.exit_when_idle:
            # Until a first rank connects, the rank that launched us may still be starting up.
            idle_exit_s = self.config.idle_exit_s if self.served_a_rank else max(
                self.config.idle_exit_s, self.config.daemon_start_timeout_s)
            if self.clients or self._busy():
                self.idle_since_s = None
            elif self.idle_since_s is None:
                self.idle_since_s = now
            elif now - self.idle_since_s >= idle_exit_s:
                self.request_stop(f"idle for {idle_exit_s:.0f} s with no ranks connected")
                return True
        return False

    def close(self) -> None:
        """Orderly cleanup: stop workers, unlink every segment this daemon owns, close sockets."""
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        self.workers.shutdown()
        for done in self.completions.drain():
            self._on_done(done)
        self.pools.release_all()
        self.ranks_watch.close()
        self.ranks.close()
        self.upstream.close()
        if self.coordinator is not None:
            self.coordinator.close()
        self.zap.close()
        self.ctx.term()
        self.completions.close()
        self.ep.socket_path.unlink(missing_ok=True)

    # --- ranks ------------------------------------------------------------------------------
    def _drain_ranks(self) -> None:
        while True:
            try:
                identity, msg, peer = self.ranks.recv()
            except zmq.Again:
                return
            if msg is None or identity is None:
                continue
            try:
                self._on_rank(identity, msg, peer)
            except (CkptdError, OSError) as exc:
                step = getattr(msg, "step", None)
                log.warning("%s from %r failed: %s", msg.TYPE.name, identity, exc)
                self.ranks.send(ErrorReply(str(exc), step), identity, block=False)
            except Exception as exc:  # noqa: BLE001 - one peer's odd request must not stop the daemon
                log.exception("%s from %r could not be handled", msg.TYPE.name, identity)
                self.ranks.send(ErrorReply(f"the node daemon could not handle {msg.TYPE.name}: "
                                           f"{type(exc).__name__}: {exc}", getattr(msg, "step", None)),
                                identity, block=False)

    def _on_rank(self, identity: bytes, msg: Message, peer: str | None) -> None:
        if isinstance(msg, Ping):
            self.ranks.send(Pong(msg.nonce, self.instance, os.getpid()), identity)
        elif isinstance(msg, Hello):
            self._on_hello(identity, msg, peer)
        elif isinstance(msg, RegisterPool):
            self._client(identity, msg.rank)
            self.pools.register(msg.rank, msg.generation, msg.slot_nbytes, msg.names, identity)
            self.ranks.send(PoolOk(msg.generation), identity)
        elif isinstance(msg, Save):
            self._on_save(identity, msg)
        elif isinstance(msg, Skip):
            self._client(identity, msg.rank)
            self._send_up(Failed(msg.step, msg.attempt, msg.rank, msg.world_size, self.ep.node,
                                 f"skipped the save: {msg.reason}"), (msg.step, msg.attempt))
            self.ranks.send(SaveAck(msg.step, msg.attempt, msg.rank), identity)
        elif isinstance(msg, Bye):
            self.clients.pop(identity, None)
            self.pools.retire_owner(identity)
        elif isinstance(msg, Status):
            self.ranks.send(StatusReply(self.status()), identity)
        elif isinstance(msg, Shutdown):
            self.ranks.send(ShutdownAck(), identity)
            self.request_stop("SHUTDOWN requested")
        else:
            raise ProtocolError(f"a node daemon does not accept {msg.TYPE.name} from ranks")

    def _on_hello(self, identity: bytes, msg: Hello, peer: str | None) -> None:
        if os.path.realpath(msg.root) != str(self.ep.root):
            raise ProtocolError(f"this daemon serves {self.ep.root}, not {msg.root}")
        # The kernel's credentials of the connection (SO_PEERCRED): a process speaks for itself only.
        pid, uid = peer_pid(peer), peer_uid(peer)
        if pid is None or uid is None:
            raise ProtocolError(f"HELLO over a connection without process credentials ({peer!r}); "
                                f"ranks connect over {self.ep.ipc_address}")
        if uid != os.getuid():
            raise ProtocolError(f"HELLO from uid {uid}; this daemon serves uid {os.getuid()} only")
        if msg.pid != pid:
            raise ProtocolError(f"HELLO says pid {msg.pid}, but the connecting process is pid {pid}")
        self.clients[identity] = Client(msg.rank, msg.pid, _create_time(msg.pid))
        self.served_a_rank = True
        self.ranks.send(Welcome(self.instance, os.getpid(), self.ep.node, str(self.ep.root)), identity)

    def _client(self, identity: bytes, rank: int | None = None) -> Client:
        """The HELLO'd client of this connection; ``rank``: the rank a request speaks for."""
        c = self.clients.get(identity)
        if c is None:
            raise ProtocolError("no HELLO from this connection; reconnect")
        if rank is not None and rank != c.rank:
            raise ProtocolError(f"this connection said HELLO as rank {c.rank}, not rank {rank}")
        return c

    def _on_save(self, identity: bytes, msg: Save) -> None:
        client = self._client(identity, msg.rank)
        if self.stopping_since is not None:
            raise CkptdError(f"the node daemon is shutting down ({self.stop_reason}); retry the save")
        pool = self.pools.get(msg.rank, msg.generation, identity)
        if not 0 <= msg.slot < len(pool.segments):
            raise StagingError(f"rank {msg.rank}: slot {msg.slot} does not exist")
        if msg.slot in pool.busy:
            raise StagingError(f"rank {msg.rank}: slot {msg.slot} is still being written")
        if msg.layout and not msg.items:
            if pool.layout is None or pool.layout[0] != msg.layout:
                raise ProtocolError(f"rank {msg.rank}: SAVE names item layout {msg.layout!r}, which this "
                                    "daemon does not hold; send the items")
            _, records, placements = pool.layout
        else:
            records, placements = self._decode_items(msg, pool.slot_nbytes)
            if msg.layout:
                pool.layout = (msg.layout, records, placements)
        snapshot = None
        if msg.snapshot_pid:
            check_snapshot_child(msg.rank, msg.snapshot_pid, client.pid, pool.registered_s)
            snapshot = SnapshotWait.open(msg.rank, msg.snapshot_pid, msg.seal, msg.seal_offset,
                                         pool.slot_nbytes)
        req = WriteRequest(msg.step, msg.rank, records, placements, msg.common)
        # created by the writer (its errors fail the save)
        directory = tmp_dir(self.ep.root, msg.step, msg.attempt)
        pool.busy.add(msg.slot)
        seg = pool.segments[msg.slot]
        cfg = self.config
        nbytes = sum(p.nbytes for p in placements)
        queued_s = time.monotonic()
        key = WriteKey(msg.step, msg.attempt, msg.rank, msg.world_size, msg.generation, msg.slot, identity,
                       msg.common, msg.common_digest, nbytes)

        def job() -> tuple[list[ItemRecord], int, float, float, float]:
            started_s = time.monotonic()
            stored, file_nbytes = write_rank_file(directory, seg, req, self.opener, cfg.fsync, cfg.checksums,
                                                  snapshot, cfg.snapshot_timeout_s)
            # The write overlaps the snapshot child's copy; the time it only waited is reported apart.
            waited_s = snapshot.waited_s if snapshot is not None else 0.0
            return stored, file_nbytes, started_s - queued_s, time.monotonic() - started_s - waited_s, waited_s

        self.metrics.save_received(msg.step)
        self.workers.write(key, job)
        self.steps[(msg.step, msg.attempt)].notify.add(identity)
        self.ranks.send(SaveAck(msg.step, msg.attempt, msg.rank), identity)
        log.info("step %d attempt %s rank %d: %d items queued from slot %d", msg.step, msg.attempt, msg.rank,
                 len(records), msg.slot)

    @staticmethod
    def _decode_items(msg: Save, slot_nbytes: int) -> tuple[list[ItemRecord], list[Placement]]:
        """Records and slot placements of a SAVE's items, each checked against the slot."""
        records, placements = [], []
        for it in msg.items:
            if not isinstance(it, dict) or set(it) != {"record", "offset", "nbytes"}:
                raise ProtocolError("SAVE item must be {record, offset, nbytes}")
            rec = ItemRecord.from_wire(it["record"])
            off, n = it["offset"], it["nbytes"]
            if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n
                    and off + n <= slot_nbytes):
                raise StagingError(f"rank {msg.rank}: item {rec.fqn!r} lies outside the slot")
            if rec.rank != msg.rank:
                raise ProtocolError(f"rank {msg.rank} sent a record of rank {rec.rank}")
            if rec.kind == "tensor" and rec.nbytes != n:
                raise StagingError(f"rank {msg.rank}: item {rec.fqn!r} has {n} bytes, its shape needs {rec.nbytes}")
            records.append(rec)
            placements.append(Placement(off, n))
        return records, placements

    # --- worker results -------------------------------------------------------------------
    def _on_done(self, done: Done) -> None:
        self.workers.finished()
        if self.coordinator is not None and self.coordinator.on_done(done):
            return
        if done.kind != "write":
            return
        k: WriteKey = done.key
        pool = self.pools.pools.get((k.rank, k.generation))
        if pool is not None:
            pool.busy.discard(k.slot)
            self.pools.collect()
        stored, file_nbytes, queue_s, write_s, snapshot_s = (done.result if done.error is None
                                                             else ([], 0, 0.0, 0.0, 0.0))
        self.metrics.write_finished(k.step, k.nbytes, write_s, queue_s, ok=done.error is None)
        self.ranks.send(SlotFree(k.generation, k.slot, k.step, k.attempt, write_s, queue_s, snapshot_s),
                        k.identity, block=False)
        step_key = (k.step, k.attempt)
        live = step_key in self.steps and k.identity in self.steps[step_key].notify
        if done.error is None and live:
            records = [r.to_wire() for r in stored]
            self._send_up(Written(k.step, k.attempt, k.rank, k.world_size, self.ep.node, records, k.common,
                                  k.common_digest, file_nbytes), step_key)
        else:
            # The coordinator answers a report of a decided attempt with its outcome and removes the
            # directory the late write re-created.
            why = (f"writing its data file failed: {done.error}" if done.error is not None
                   else "its data file was written after the attempt had been decided (late write)")
            self._send_up(Failed(k.step, k.attempt, k.rank, k.world_size, self.ep.node, why), step_key)

    # --- coordinator ----------------------------------------------------------------------
    def _send_up(self, msg: Message, key: StepKey) -> None:
        st = self.steps[key]
        if st.waiting_since is None:
            st.waiting_since = time.monotonic()
        st.reports.append(msg)
        if self.upstream.send(msg, block=False):
            st.sent_to = st.sent_to or self.coordinator_instance
        else:
            self.outbox.append((time.monotonic(), msg, key))

    def _drain_upstream(self) -> None:
        while True:
            try:
                _, msg, _ = self.upstream.recv()
            except zmq.Again:
                return
            if msg is None:
                continue
            if isinstance(msg, Pong):
                silent_s = time.monotonic() - self.last_pong_s
                self.last_pong_s = time.monotonic()
                if self.coordinator_instance != msg.instance:
                    if self.coordinator_instance is not None:
                        log.warning("coordinator restarted (%s -> %s)", self.coordinator_instance, msg.instance)
                    self.coordinator_instance = msg.instance
                    self._abort_pending("the coordinator restarted before confirming the step (had "
                                        "its commit already renamed the checkpoint, the restarted "
                                        "coordinator completes it)",
                                        keep_instance=msg.instance)
                if silent_s > self.link_timeout_s / 2:  # long enough that the connection may have been replaced
                    self._resend_reports(silent_s)
            elif isinstance(msg, (StepCommitted, StepAborted)):
                self._resolve((msg.step, msg.attempt), msg)
            elif isinstance(msg, ErrorReply):
                log.warning("coordinator error: %s", msg.reason)
            else:
                log.warning("unexpected %s from the coordinator", msg.TYPE.name)

    def _resend_reports(self, silent_s: float) -> None:
        """The coordinator answers again after a silence long enough for the connection to have
        been replaced (ckptd.control.channel.replace_dead_links), which loses what was in it (a
        report, or the verdict on it: without a resend this node would wait for it forever, since
        the coordinator answers its pings again). Resend every report still awaiting a verdict:
        the coordinator counts a report once and answers one about a decided attempt with its
        outcome."""
        waiting = [(key, msg) for key, st in self.steps.items() for msg in st.reports]
        if waiting:
            log.warning("the coordinator answers again after %.1f s; resending %d reports of steps %s",
                        silent_s, len(waiting), sorted({key for key, _ in waiting}))
        for key, msg in waiting:
            if not self.upstream.send(msg, block=False):
                self.outbox.append((time.monotonic(), msg, key))

    def _resolve(self, key: StepKey, outcome: Message) -> None:
        st = self.steps.pop(key, None)
        self.outbox = [o for o in self.outbox if o[2] != key]
        if st is None:
            return
        self.metrics.resolved(key[0], committed=isinstance(outcome, StepCommitted))
        for identity in st.notify:
            self.ranks.send(outcome, identity, block=False)

    def _abort_pending(self, reason: str, keep_instance: str | None = None) -> None:
        for (step, attempt), st in list(self.steps.items()):
            if st.waiting_since is None:
                continue  # still writing here; it reports once done
            if keep_instance is not None and st.sent_to in (None, keep_instance):
                continue
            log.warning("step %d attempt %s aborted locally: %s", step, attempt, reason)
            self._resolve((step, attempt), StepAborted(step, attempt, reason))
            self.late.append((time.monotonic(), Failed(step, attempt, -1, 0, self.ep.node, reason)))

    def _tick(self, now: float) -> None:
        cfg = self.config
        if self.metrics_server is not None:
            self.status_cache = self.status()
        if self.coordinator is not None:
            self.coordinator.tick(now)
        waiting = [st for st in self.steps.values() if st.waiting_since is not None]
        if now - self.last_ping_s >= cfg.heartbeat_s:
            # Also while idle: a restarted coordinator's instance is known before the next report.
            self.last_ping_s = now
            self.upstream.send(Ping(int(now * 1000)), block=False)
        if waiting or self.outbox:
            oldest = min([st.waiting_since for st in waiting] + [o[0] for o in self.outbox])  # type: ignore[type-var]
            silent_s = now - max(self.last_pong_s, oldest)
            if silent_s > cfg.coordinator_timeout_s:
                self.outbox.clear()
                self._abort_pending(f"the coordinator at {self.ep.coordinator_connect} did not answer "
                                    f"for {silent_s:.0f} s (node 0's daemon may have died, or the network "
                                    "between this node and node 0 failed; a step whose reports all reached "
                                    "the coordinator may still commit: Checkpointer.latest() tells)")
        else:
            self.last_pong_s = now
        if self.late:
            self.late = [(t, m) for t, m in self.late if now - t < cfg.commit_timeout_s
                         and not self.upstream.send(m, block=False)]
        if self.outbox:
            retry, self.outbox = self.outbox, []
            for first, msg, key in retry:
                if self.upstream.send(msg, block=False):
                    self.steps[key].sent_to = self.coordinator_instance
                else:
                    self.outbox.append((first, msg, key))
        if now - self.last_check_s >= cfg.heartbeat_s:
            self.last_check_s = now
            for identity, c in list(self.clients.items()):
                if not _alive(c.pid, c.create_time):
                    log.info("rank %d (pid %d) is gone; its pool is released once idle", c.rank, c.pid)
                    del self.clients[identity]
                    self.pools.retire_owner(identity)

    def rejected(self) -> dict[str, int]:
        """Rejections on the ranks' socket (and the upstream one), by kind."""
        return {"malformed": self.ranks.rejected + self.upstream.rejected, **self.ranks_watch.counts()}

    def status(self) -> dict[str, Any]:
        rejected = self.rejected()
        coordinator = self.coordinator.status() if self.coordinator is not None else None
        return {
            "instance": self.instance,
            "pid": os.getpid(),
            "node": self.ep.node,
            "root": str(self.ep.root),
            "job": self.ep.job,
            "clients": [{"rank": c.rank, "pid": c.pid} for c in self.clients.values()],
            "pools": self.pools.summary(),
            "jobs_in_flight": self.workers.in_flight,
            "pending_steps": sorted({step for step, _ in self.steps}),
            # The coordinator as this node knows it: its instance, and how long it has not answered
            # a ping while steps wait for it (0 while none does).
            "upstream": {"address": self.ep.coordinator_connect, "instance": self.coordinator_instance,
                         "silent_s": round(time.monotonic() - self.last_pong_s, 3)},
            # Every rejection of this daemon, its coordinator's port included (ckptd_rejected_messages_total).
            "rejected_messages": sum(rejected.values()) + (coordinator["rejected_messages"] if coordinator else 0),
            "rejected": rejected,
            "coordinator": coordinator,
            "stopping": self.stopping_since is not None,
            "metrics": self.metrics.snapshot(),
        }


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _alive(pid: int, create_time: float | None) -> bool:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(p.create_time() - create_time) < 1e-3
    except psutil.Error:
        return False
