"""The ranks' side of a node daemon: their socket, who they are, and what they ask.

Ranks connect to a CurveZMQ ROUTER on ``ipc://`` in the owner-only runtime directory. Order per
connection (see ckptd.control.protocol): ``HELLO`` (its pid must be the connecting process's, as
the kernel reports it, of this daemon's user) -> ``REGISTER_RING`` (the rank's staging ring, bound
to this connection) -> ``REGISTER_LAYOUT`` (from ``prepare()``: the item list of the saves to
come) -> ``SAVE``/``SKIP`` per save -> ``BYE``. A resume asks ``IN_FLIGHT`` and may send
``ABANDON`` (after ``HELLO``). ``PING``, ``STATUS`` and ``SHUTDOWN`` are served at any time. Every
heartbeat the ranks' processes are checked: a dead rank's ring is released once its writes
finished.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from ..control.channel import Channel, make_socket, peer_pid, peer_uid
from ..control.codec import Codec
from ..control.endpoints import Endpoints, canonical_root
from ..control.keys import CurveKeys
from ..control.netaddr import tcp_port
from ..control.protocol import (
    Abandon,
    Bye,
    Failed,
    Hello,
    InFlight,
    InFlightReply,
    LayoutOk,
    Message,
    Ping,
    Pong,
    RegisterLayout,
    RegisterRing,
    RingOk,
    Save,
    SaveAck,
    Shutdown,
    ShutdownAck,
    Skip,
    Status,
    StatusReply,
    Welcome,
)
from ..control.security import HandshakeWatch
from ..control.wiretext import bounded_text
from ..errors import CkptdError, ProtocolError, RankHeldError, UnknownClientError
from ..procid import same_process, start_ticks_of
from .intake import SaveIntake
from .loop import serve_requests
from .rings import RingTable
from .uplink import CoordinatorLink

# A root path longer than Linux's PATH_MAX is refused before it is resolved.
MAX_ROOT_CHARS = 4096

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Client:
    """A connection that said HELLO: the rank it speaks for and its process."""

    rank: int
    pid: int
    start_ticks: int | None  # the process's start (ckptd.procid): a reused pid is not it
    coordinator: str = ""  # where its launch has the coordinator (Hello.coordinator)


@dataclass(frozen=True)
class DaemonHooks:
    """What the rank server asks of the daemon around it."""

    instance: str
    status: Callable[[], dict[str, Any]]
    request_stop: Callable[[str], None]
    stopping: Callable[[], str | None]  # why the daemon is stopping (None while it serves)
    # a HELLO's coordinator address, and whether its launch is the newest (ckptd.daemon.node)
    follow_coordinator: Callable[[str, bool], None]


class RankServer:
    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        keys: CurveKeys,
        ep: Endpoints,
        rings: RingTable,
        intake: SaveIntake,
        uplink: CoordinatorLink,
        hooks: DaemonHooks,
    ) -> None:
        self.ep = ep
        self.rings = rings
        self.intake = intake
        self.uplink = uplink
        self.hooks = hooks
        self.clients: dict[bytes, Client] = {}
        self.saving: set[bytes] = set()  # connections that sent a SAVE or a layout (_refuse_second_writer)
        self.served_a_rank = False
        old_umask = os.umask(0o077)  # the socket file: owner-only
        try:
            ep.socket_path.unlink(missing_ok=True)
            sock = make_socket(ctx, zmq.ROUTER, codec, keys, server=True)
            self.watch = HandshakeWatch(sock, "daemon")  # before bind: no connection unwatched
            self.channel = Channel(sock, codec, "node daemon")
            sock.bind(ep.ipc_address)
        finally:
            os.umask(old_umask)

    def rebind(self) -> None:
        """Bind the socket again at its path, whose file was removed (ckptd.daemon.runfiles): a
        second listener, so that the connections made through the first stay (unbinding it would
        drop them). Made owner-only by chmod, not by the umask: the writer threads create files
        meanwhile, with the daemon's umask."""
        self.ep.socket_path.unlink(missing_ok=True)
        self.channel.sock.bind(self.ep.ipc_address)
        os.chmod(self.ep.socket_path, 0o600)

    def send(self, msg: Message, identity: bytes) -> None:
        """Send to a rank without blocking (a rank that is gone misses it)."""
        self.channel.send(msg, identity, block=False)

    def on_readable(self) -> None:
        serve_requests(self.channel, self._on_request)

    def _on_request(self, identity: bytes, msg: Message, peer: str | None) -> None:
        if isinstance(msg, Ping):
            self.channel.send(Pong(nonce=msg.nonce, instance=self.hooks.instance, pid=os.getpid()), identity)
        elif isinstance(msg, Hello):
            self._on_hello(identity, msg, peer)
        elif isinstance(msg, (RegisterRing, RegisterLayout, Save, Skip)):
            self._on_writer_request(identity, msg)
        elif isinstance(msg, Abandon):
            # Not refused from a second launch's process (its resume, while its predecessor's rank
            # is still exiting): an attempt whose saving process still runs is never abandoned.
            # A rank asks for its own saves only: the coordinator keeps an attempt whose abandoning
            # ranks' reports it counted, so one named for another rank would decide for that rank.
            self.client(identity, None if msg.abandoning_rank < 0 else msg.abandoning_rank)
            if any(
                (a.step, a.attempt, a.live) == (msg.step, msg.attempt, True)
                for a in self.intake.in_flight(self._connected)
            ):
                raise CkptdError(
                    f"step {msg.step} attempt {msg.attempt} is saved by a launch still running: not aborted"
                )
            self.uplink.abandon((msg.step, msg.attempt), msg.reason, tuple(msg.handed_off), msg.abandoning_rank)
            self.channel.send(SaveAck(step=msg.step, attempt=msg.attempt), identity)
        elif isinstance(msg, Bye):
            self.clients.pop(identity, None)
            self.saving.discard(identity)
            self.rings.retire_owner(identity)
        elif isinstance(msg, InFlight):
            self.client(identity)
            self.channel.send(InFlightReply(attempts=self.intake.in_flight(self._connected)), identity)
        elif isinstance(msg, Status):
            self.channel.send(StatusReply(info=self.hooks.status()), identity)
        elif isinstance(msg, Shutdown):
            self.channel.send(ShutdownAck(), identity)
            self.hooks.request_stop("SHUTDOWN requested")
        else:
            raise ProtocolError(f"a node daemon does not accept {msg.TYPE.name} from ranks")

    def _on_writer_request(self, identity: bytes, msg: RegisterRing | RegisterLayout | Save | Skip) -> None:
        """The requests that save or decide saves: refused from a process of a rank that another
        running process saves as (:meth:`_refuse_second_writer`)."""
        self._refuse_second_writer(identity, self.client(identity, msg.rank))
        if isinstance(msg, RegisterRing):
            self.rings.register(msg.rank, msg.generation, msg.ring_nbytes, msg.names, identity)
            self.channel.send(RingOk(generation=msg.generation), identity)
        elif isinstance(msg, RegisterLayout):
            self.intake.register_layout(identity, msg)
            self.saving.add(identity)  # (once taken: a refused one holds nothing)
            self.channel.send(LayoutOk(layout=msg.layout), identity)
        elif isinstance(msg, Save):
            client = self.client(identity, msg.rank)
            stopping = self.hooks.stopping()
            if stopping is not None:
                raise CkptdError(f"the node daemon is shutting down ({stopping}); retry the save")
            start_write = self.intake.take(identity, client.pid, msg)
            try:
                self.saving.add(identity)
                self.channel.send(SaveAck(step=msg.step, attempt=msg.attempt), identity)
                decided = self.uplink.verdict((msg.step, msg.attempt))
                if decided is not None:  # another rank skipped or failed the step before this SAVE came
                    self.channel.send(decided, identity)
            finally:
                # After the answer: a writer thread started first takes the interpreter from this
                # one while the rank waits in save() (the answer came 1-3 ms later, a lazy save's
                # whole stall 5.3 ms against 4.0).
                start_write()
        elif isinstance(msg, Skip):
            self.uplink.report(
                Failed(
                    step=msg.step,
                    attempt=msg.attempt,
                    rank=msg.rank,
                    world_size=msg.world_size,
                    node=self.ep.node,
                    reason=bounded_text(f"skipped the save: {msg.reason}"),  # (it must fit a message with more fields)
                    skipped=msg.skipped,
                ),
                (msg.step, msg.attempt),
            )
            self.channel.send(SaveAck(step=msg.step, attempt=msg.attempt), identity)

    def _on_hello(self, identity: bytes, msg: Hello, peer: str | None) -> None:
        root = self.ep.root
        if len(msg.root) > MAX_ROOT_CHARS:  # resolving it costs time on the daemon's loop
            raise ProtocolError(f"HELLO names a root of {len(msg.root)} characters; this daemon serves {root}")
        try:
            asked = canonical_root(msg.root)
        except CkptdError as exc:
            raise ProtocolError(f"HELLO names the root {msg.root[:200]!r}: {bounded_text(str(exc), 1000)}") from None
        if str(asked) != str(root):
            raise ProtocolError(f"this daemon serves {root}, not {msg.root[:200]}")
        # The kernel's credentials of the connection (SO_PEERCRED): a process speaks for itself only.
        pid, uid = peer_pid(peer), peer_uid(peer)
        if pid is None or uid is None:
            raise ProtocolError(
                f"HELLO over a connection without process credentials ({peer!r}); "
                f"ranks connect over {self.ep.ipc_address}"
            )
        if uid != os.getuid():
            raise ProtocolError(f"HELLO from uid {uid}; this daemon serves uid {os.getuid()} only")
        if msg.pid != pid:
            raise ProtocolError(f"HELLO says pid {msg.pid}, but the connecting process is pid {pid}")
        client = Client(msg.rank, msg.pid, start_ticks_of(msg.pid), msg.coordinator)
        known = self.clients.get(identity)
        if known is not None and known.rank != client.rank:
            self.saving.discard(identity)  # it saved as another rank
        if msg.coordinator:
            self.hooks.follow_coordinator(msg.coordinator, self._newest_launch(identity, client))
        self.clients[identity] = client
        self.served_a_rank = True
        self.channel.send(Welcome(instance=self.hooks.instance, pid=os.getpid()), identity)

    def _refuse_second_writer(self, identity: bytes, client: Client) -> None:
        """Refuse a request that saves from a process of a rank that another process which still
        runs saves as (it sent a SAVE or its layout): the same job launched twice on this machine
        reaches this daemon (its job id is the root's), where the root's lock cannot tell the
        launches apart, and each launch's commits would roll back and remove the other's
        checkpoints. A process that only loads (an evaluation's Checkpointer, rank 0 by default,
        which may hold a ring it never saves from) holds the rank for nobody; a rank restarted
        after a crash finds its predecessor gone (a process that exited, or a zombie, does not
        count); the same process (a second Checkpointer) is the same rank."""
        for other_id, other in self.clients.items():
            if (
                other_id != identity
                and other.rank == client.rank
                and other.pid != client.pid
                and other_id in self.saving
                and self._connected(other_id)
            ):
                raise RankHeldError(
                    f"rank {client.rank} of {self.ep.root} (node {self.ep.node}) is saved by another process "
                    f"that still runs (pid {other.pid}): two launches saving into one root roll back and "
                    "remove each other's checkpoints. Stop the other launch or wait for it to exit, or "
                    "give this one its own root"
                )

    def _newest_launch(self, identity: bytes, new: Client) -> bool:
        """Whether the daemon follows the coordinator address of ``new``'s HELLO: unless a running
        process that said HELLO with another address started after it (a rank of the earlier
        launch that says HELLO again must not take the daemon back from the relaunch). A running
        process of another address that started before it is most likely a rank of the earlier
        launch not reaped yet (stuck in a hung filesystem, say): followed past, with a warning, as
        refusing would keep the relaunch from saving at all (were it a launch still running, two
        launches with different MASTER_ADDR/MASTER_PORT on one job id, its saves abort for want of
        their coordinator, and the warning says why)."""
        address = new.coordinator
        if tcp_port(address) == 0:  # (one of another form raises)
            raise ProtocolError(f"HELLO names the coordinator address {address!r}, without a port")
        others = [
            c
            for other, c in self.clients.items()
            if other != identity and c.coordinator not in ("", address) and self._connected(other)
        ]
        if new.start_ticks is not None and any(
            c.start_ticks is not None and c.start_ticks > new.start_ticks for c in others
        ):
            log.warning(
                "rank %d (pid %d) says its launch has the coordinator at %s, but a process started after it "
                "has another: not followed (a rank of an earlier launch?)",
                new.rank,
                new.pid,
                address,
            )
            return False
        for c in others:
            log.warning(
                "rank %d (pid %d), whose launch has the coordinator at %s, still runs; rank %d's launch "
                "has it at %s, which this daemon follows from now on (two launches with different "
                "MASTER_ADDR/MASTER_PORT on one job: give each its own CKPTD_JOB_ID)",
                c.rank,
                c.pid,
                c.coordinator,
                new.rank,
                address,
            )
        return True

    def client(self, identity: bytes, rank: int | None = None) -> Client:
        """The HELLO'd client of this connection; ``rank``: the rank a request speaks for."""
        c = self.clients.get(identity)
        if c is None:
            raise UnknownClientError(
                "this daemon does not know the connection (no HELLO, or it took the rank for gone); "
                "say HELLO and register the staging ring again"
            )
        if rank is not None and rank != c.rank:
            raise ProtocolError(f"this connection said HELLO as rank {c.rank}, not rank {rank}")
        return c

    def _connected(self, identity: bytes) -> bool:
        """Whether the rank connected as ``identity`` is still connected and running."""
        c = self.clients.get(identity)
        return c is not None and same_process(c.pid, c.start_ticks)

    def forget_dead(self) -> None:
        """Drop ranks whose process is gone; their rings are released once idle."""
        for identity, c in list(self.clients.items()):
            if not same_process(c.pid, c.start_ticks):
                log.info("rank %d (pid %d) is gone; its ring is released once idle", c.rank, c.pid)
                del self.clients[identity]
                self.saving.discard(identity)
                self.rings.retire_owner(identity)

    def rejected(self) -> dict[str, int]:
        """Rejections on the ranks' socket, by kind."""
        return {"malformed": self.channel.rejected, **self.watch.counts()}

    def close(self) -> None:
        self.watch.close()
        self.channel.close()
        self.ep.socket_path.unlink(missing_ok=True)
