"""ZeroMQ sockets that speak :mod:`ckptd.control.protocol`: send typed messages, receive checked ones.

Every socket runs CurveZMQ with the job's keys (:mod:`ckptd.control.keys`): servers (a daemon's
rank socket, the coordinator's port) accept only clients holding the job's client key (the ZAP
handler of :mod:`ckptd.control.security`), clients talk only to a server holding the job's server
key, and every frame is encrypted and authenticated within its session. Messages travel in
frames of at most :data:`~ckptd.control.protocol.FRAME_NBYTES`, and libzmq refuses larger frames
(dropping the connection) on every socket, also during the handshake: a connection that has not
authenticated can make the daemon hold at most one such frame.

Malformed or oversized input never raises out of a server's loop: ``recv`` returns no message for
it after logging why (the sender's identity included), and the server keeps serving.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import zmq

from ..errors import ProtocolError
from .codec import Codec
from .keys import CurveKeys
from .protocol import FRAME_NBYTES, Message
from .security import make_client_secure, make_server_secure

log = logging.getLogger(__name__)

# Frame bytes above the frame size (or a smaller message limit) that still reach the codec, which
# rejects and counts what is too big; anything larger makes libzmq drop the connection.
ENVELOPE_NBYTES = 4096
ROUTER_SEND_TIMEOUT_MS = 2000


def make_socket(
    ctx: zmq.Context, kind: int, codec: Codec, keys: CurveKeys, *, server: bool, identity: bytes | None = None
) -> zmq.Socket:
    """A CurveZMQ socket of the job: ``server`` for ROUTERs that bind, else a client."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, min(codec.max_nbytes, FRAME_NBYTES) + ENVELOPE_NBYTES)
    if server:
        make_server_secure(sock, keys)
    else:
        make_client_secure(sock, keys)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A blocking send to a peer that is alive but reads nothing (its queue full) would stop the
        # daemon's whole loop: it gives up after this long instead (Channel.send returns False, as
        # for a peer that is gone: a node resends its reports, a rank's request times out).
        sock.setsockopt(zmq.SNDTIMEO, ROUTER_SEND_TIMEOUT_MS)
    return sock


def link_timeout_s(heartbeat_s: float, coordinator_timeout_s: float) -> float:
    """How long a TCP connection between daemons may carry nothing before it is replaced: a
    third of the coordinator timeout (so a replaced connection still delivers before steps
    abort), and at least four heartbeats."""
    return max(4 * heartbeat_s, coordinator_timeout_s / 3)


def replace_dead_links(sock: zmq.Socket, heartbeat_s: float, timeout_s: float) -> None:
    """Make a ``tcp://`` socket between daemons replace a connection that went silent.

    A partition inside the network (a failed switch: both ends keep their links) makes TCP
    retransmit with exponential back-off, so after a partition of a minute the next retransmission
    may come a minute after the network healed, and until then every report waits in that
    connection. Here libzmq's I/O thread sends a ZMTP heartbeat every ``heartbeat_s`` and drops a
    connection that carried nothing for ``timeout_s``; the connecting side then connects anew,
    each try bounded by ``timeout_s`` (a SYN lost in the partition is otherwise retried with the
    same back-off), so it is back within about ``timeout_s`` of the network. A ROUTER lets the
    new connection take over its peer's identity from the old one it may still hold
    (``ROUTER_HANDOVER``; else it would refuse the peer until the old one timed out too).
    Messages that were in the dropped connection are lost: senders resend what is unanswered.
    """
    ivl_ms = max(10, int(heartbeat_s * 1000))
    timeout_ms = max(2 * ivl_ms, int(timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, timeout_ms)
    sock.setsockopt(zmq.CONNECT_TIMEOUT, timeout_ms)
    if sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)


class Incoming(NamedTuple):
    """One received message: the peer's routing identity (ROUTER only), the message (None when
    rejected) and the peer's address as libzmq saw it (``...:uid:gid:pid`` on ``ipc://``)."""

    identity: bytes | None
    msg: Message | None
    peer: str | None


def peer_pid(peer: str | None) -> int | None:
    """The connecting process's pid from an ``ipc://`` peer address (the kernel's SO_PEERCRED)."""
    if not peer:
        return None
    parts = peer.rsplit(":", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[1:]):
        return None
    return int(parts[3])


def peer_uid(peer: str | None) -> int | None:
    """The connecting process's uid from an ``ipc://`` peer address."""
    if peer_pid(peer) is None:
        return None
    return int(peer.rsplit(":", 3)[1])  # type: ignore[union-attr]


class Channel:
    """One socket plus the codec of its job. ROUTER sockets address peers by identity."""

    def __init__(self, sock: zmq.Socket, codec: Codec, name: str) -> None:
        self.sock = sock
        self.codec = codec
        self.name = name
        self.is_router = sock.type == zmq.ROUTER
        self.rejected = 0  # messages from authenticated peers that failed the codec's checks

    def send(self, msg: Message, identity: bytes | None = None, block: bool = True) -> bool:
        """Send ``msg``; False when it cannot be delivered now (peer gone, or not connected)."""
        frames = self.codec.encode(msg)
        if self.is_router:
            if identity is None:
                raise ProtocolError(f"{self.name}: a ROUTER send needs the peer identity")
            frames = [identity, *frames]
        try:
            self.sock.send_multipart(frames, flags=0 if block else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.debug("%s: peer %r is gone; %s dropped", self.name, identity, msg.TYPE.name)
                return False
            raise
        return True

    def recv(self) -> Incoming:
        """One message (non-blocking; raises zmq.Again when none is waiting)."""
        frames: list[Any] = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        identity = None
        if self.is_router:
            identity, frames = frames[0].bytes, frames[1:]
        peer = frames[-1].get("Peer-Address") if frames else None
        try:
            return Incoming(identity, self.codec.decode([f.buffer for f in frames]), peer)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("%s: rejected a message from %r: %s", self.name, identity, exc)
            return Incoming(identity, None, peer)

    def close(self) -> None:
        self.sock.close(linger=0)
