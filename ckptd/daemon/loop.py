"""The daemon's one event loop, and the receive-and-dispatch of its request sockets.

Everything a node daemon does happens on one thread, in reaction to a readable source: a socket
(ranks' requests, the coordinator's verdicts, node reports on node 0's coordinator port, ZAP
requests and handshake events) or a descriptor (the completion pipe of the writer and commit
threads, woken by signals too), plus a periodic tick for timeouts and heartbeats. Handlers never
block, so one slow peer never stalls the others.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from ..control.channel import Channel
from ..control.protocol import ErrorReply, Message
from ..control.wiretext import bounded_text
from ..errors import CkptdError

log = logging.getLogger(__name__)

RequestHandler = Callable[[bytes, Message, "str | None"], None]


class EventLoop:
    """A zmq poller over sockets and file descriptors, each registered with its handler."""

    def __init__(self) -> None:
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[], None]] = {}

    def add(self, source: zmq.Socket | int, handler: Callable[[], None]) -> None:
        """Call ``handler()`` whenever ``source`` is readable (in the order sources were added)."""
        self._poller.register(source, zmq.POLLIN)
        self._handlers[source] = handler

    def poll(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for a readable source, then run the handler of each one."""
        for source, _ in self._poller.poll(timeout_ms):
            self._handlers[source]()


def serve_requests(channel: Channel, handle: RequestHandler) -> None:
    """Receive every message waiting on the ROUTER ``channel`` and pass it to ``handle(identity,
    message, peer)``. A request the handler fails on is answered with ``ERROR``: a CkptdError or
    OSError with its message (logged as a warning), anything else with its type (logged with its
    traceback); either way the server goes on serving. Malformed input was already rejected,
    counted and logged by the channel."""
    while True:
        try:
            identity, msg, peer = channel.recv()
        except zmq.Again:
            return
        if msg is None or identity is None:
            continue
        step, attempt = getattr(msg, "step", None), getattr(msg, "attempt", "")
        try:
            handle(identity, msg, peer)
        except (CkptdError, OSError) as exc:
            log.warning("%s: %s from %r failed: %s", channel.name, msg.TYPE.name, identity, exc)
            refusal = ErrorReply(
                reason=bounded_text(str(exc)),
                step=step,
                code=getattr(exc, "code", ""),
                request=int(msg.TYPE),
                refused_attempt=attempt,
            )
            channel.send(refusal, identity, block=False)
        except Exception as exc:
            log.exception("%s: %s from %r could not be handled", channel.name, msg.TYPE.name, identity)
            channel.send(
                ErrorReply(
                    reason=bounded_text(
                        f"the {channel.name} could not handle {msg.TYPE.name}: {type(exc).__name__}: {exc}"
                    ),
                    step=step,
                    request=int(msg.TYPE),
                    refused_attempt=attempt,
                ),
                identity,
                block=False,
            )
