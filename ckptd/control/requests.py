"""The client side of the control plane: one request, one reply, a bounded wait.

Every caller that asks a daemon something (a rank's Checkpointer through ckptd.client.link,
``ckptd status`` and ``ckptd daemon stop`` through ckptd.client.admin) goes through
:class:`RequestClient`, so a reply is read the same way everywhere:

- the expected reply type (and, where given, a ``match`` on it) is the answer;
- ``ERROR`` that answers this request raises :class:`~ckptd.errors.RequestNotTaken` at once, with
  the daemon's reason and code (an ``ERROR`` naming another request type or another step is the
  late refusal of an earlier request: logged, not taken for this one's);
- anything else is a notification for ``on_other`` (a rank's link), or, for a caller that
  expects none, a :class:`~ckptd.errors.ProtocolError` naming what came instead;
- no answer within ``timeout_s`` raises :class:`~ckptd.errors.DaemonError` naming the peer, the
  wait and where to look; a peer that is found dead meanwhile (``check_alive``) raises at once.

Order of use: ``RequestClient(channel, peer, ...)`` on a connected DEALER, then
:meth:`~RequestClient.request` (and :meth:`~RequestClient.next` for notifications) any number of
times, on one thread; the owner closes the socket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import zmq

from ..errors import DaemonError, ProtocolError, RequestNotTaken
from .channel import Channel
from .protocol import ErrorReply, Message, MsgType

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

# How often a wait looks whether the peer still lives (check_alive).
POLL_S = 0.05


def answer(
    request: Message,
    reply: Message,
    reply_type: type[M],
    match: Callable[[M], bool] | None = None,
    peer: str = "the daemon",
) -> M | None:
    """``reply`` if it answers ``request``; None for a message that does not (a notification,
    another request's reply, a late ERROR naming another step). An ERROR that answers
    ``request`` raises RequestNotTaken with ``peer``, its reason and its code."""
    if isinstance(reply, reply_type) and (match is None or match(reply)):
        return reply
    if isinstance(reply, ErrorReply) and refuses(reply, request):
        raise RequestNotTaken(f"{peer} refused {request.TYPE.name}: {reply.reason}", reply.code)
    return None


def refuses(reply: ErrorReply, request: Message) -> bool:
    """Whether an ERROR refuses ``request``: it names the request's type and attempt (or none), and
    no step or the request's (a late refusal of another request, e.g. of a REGISTER_LAYOUT or an
    earlier try of the step that timed out, must not cancel a SAVE the daemon took)."""
    if reply.request and reply.request != request.TYPE:
        return False
    tried = getattr(request, "attempt", "")
    if reply.refused_attempt and tried and reply.refused_attempt != tried:  # an earlier try of the step
        return False
    asked = getattr(request, "step", None)
    return reply.step is None or asked is None or reply.step == asked


class RequestClient:
    """Requests over one connected client socket (a DEALER) to one peer.

    ``peer``: how errors name the other side ("the node daemon of /ckpt node 0"); ``hint``: what
    to do when it does not answer (where its log is, what else to check). ``on_other``: receives
    messages that answer no request (a rank's notifications); None: such a message is a protocol
    error. ``check_alive``: called between polls, raises when the peer is known to be gone.
    """

    def __init__(
        self,
        channel: Channel,
        peer: str,
        hint: str,
        *,
        on_other: Callable[[Message], None] | None = None,
        check_alive: Callable[[], None] | None = None,
    ) -> None:
        self.channel = channel
        self.peer = peer
        self.hint = hint
        self.on_other = on_other
        self.check_alive = check_alive

    def send(self, msg: Message) -> None:
        """Send ``msg`` (bounded by the socket's send timeout); RequestNotTaken when it cannot."""
        if not self.channel.send(msg):
            raise RequestNotTaken(f"could not send {msg.TYPE.name} to {self.peer}; {self.hint}")

    def request(
        self, msg: Message, reply_type: type[M], timeout_s: float, match: Callable[[M], bool] | None = None
    ) -> M:
        """Send ``msg`` and return its ``reply_type`` answer (one ``match`` accepts, when given)."""
        self.send(msg)
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self.next(deadline)
            if reply is None:
                raise DaemonError(f"{self.peer} did not answer {msg.TYPE.name} within {timeout_s:g} s; {self.hint}")
            got = answer(msg, reply, reply_type, match, self.peer)
            if got is not None:
                return got
            if isinstance(reply, ErrorReply):
                asked = MsgType(reply.request).name if reply.request in MsgType._value2member_map_ else "a request"
                log.warning("%s refused an earlier %s (step %s): %s", self.peer, asked, reply.step, reply.reason)
            elif self.on_other is not None:
                self.on_other(reply)
            else:
                raise ProtocolError(
                    f"{self.peer} answered {msg.TYPE.name} with {reply.TYPE.name}, expected "
                    f"{reply_type.TYPE.name}; run the same ckptd version on both sides"
                )

    def next(self, deadline: float) -> Message | None:
        """The next valid message before ``deadline`` (monotonic), or None; ``check_alive`` runs
        between polls, so a dead peer raises at once instead of after the wait."""
        sock = self.channel.sock
        while True:
            remaining_s = deadline - time.monotonic()
            if sock.poll(max(0, int(min(POLL_S, remaining_s) * 1000)), zmq.POLLIN):
                _, msg, _ = self.channel.recv()
                if msg is not None:
                    return msg
                continue
            if self.check_alive is not None:
                self.check_alive()
            if remaining_s <= 0:
                return None
