"""ZeroMQ sockets that speak :mod:`ckptd.control.protocol`: send typed messages, receive checked ones.

Malformed, oversized or unauthenticated input never raises out of a server's loop: ``recv``
returns None for it after logging why (the sender's identity included), and the server keeps
serving.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from ..errors import ProtocolError
from .protocol import Codec, Message

log = logging.getLogger(__name__)


def make_socket(ctx: zmq.Context, kind: int, codec: Codec, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # Frames above the limit are dropped by libzmq before they reach Python (the peer is cut off).
    sock.setsockopt(zmq.MAXMSGSIZE, codec.max_nbytes + 4096)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


class Endpoint:
    """One socket plus the codec of its job. ROUTER sockets address peers by identity."""

    def __init__(self, sock: zmq.Socket, codec: Codec, name: str) -> None:
        self.sock = sock
        self.codec = codec
        self.name = name
        self.is_router = sock.type == zmq.ROUTER
        self.rejected = 0

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

    def recv(self) -> tuple[bytes | None, Message | None]:
        """One message (non-blocking): ``(identity, message)``; message None for rejected input."""
        frames: list[Any] = self.sock.recv_multipart(flags=zmq.NOBLOCK)
        identity = None
        if self.is_router:
            identity, frames = frames[0], frames[1:]
        try:
            return identity, self.codec.decode(frames)
        except ProtocolError as exc:
            self.rejected += 1
            log.warning("%s: rejected a message from %r: %s", self.name, identity, exc)
            return identity, None

    def close(self) -> None:
        self.sock.close(linger=0)
