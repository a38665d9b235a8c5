"""The server side of CurveZMQ: who may complete a handshake, and counting those who may not.

libzmq runs the CurveZMQ handshake itself; before it accepts a client it asks the context's ZAP
handler (ZeroMQ Authentication Protocol, RFC 27) whether that client's public key may connect.
:class:`ZapHandler` answers those requests from the daemon's own loop: only the job's derived
client key passes (:mod:`ckptd.control.keys`). Server sockets enforce the ZAP domain, so without a
handler no client connects at all (fail closed).

:class:`HandshakeWatch` reads a server socket's monitor events and counts connections that never
authenticated: a refused client key, a wrong server key, a client without CurveZMQ, a broken
handshake (libzmq reports these), and connections dropped before any handshake outcome (bytes that
are not ZeroMQ, a handshake frame above the size limit). Monitor events do not name the connection
of a handshake outcome, so a drop is counted only when no outcome arrived while that connection
was open: under many concurrent strangers some drops go uncounted, none is counted twice.
"""

from __future__ import annotations

import hmac
import logging

import zmq
from zmq.utils.monitor import parse_monitor_message

from .keys import CurveKeys

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"ckptd"
_LOG_FIRST = 10  # warnings logged per counter before only every _LOG_EVERY-th one is
_LOG_EVERY = 1000

_OUTCOMES: dict[int, str | None] = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: None,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key refused (no job token, or another job's)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        "broken handshake (plain ZeroMQ without CurveZMQ, wrong server key, malformed)"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake aborted",
}


def _log_rate_limited(count: int, msg: str, *args: object) -> None:
    if count <= _LOG_FIRST or count % _LOG_EVERY == 0:
        log.warning(msg + " (%d so far)", *args, count)


def make_server_secure(sock: zmq.Socket, keys: CurveKeys) -> None:
    """CurveZMQ server with the job's server key; every client must pass the ZAP handler."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def make_client_secure(sock: zmq.Socket, keys: CurveKeys) -> None:
    """CurveZMQ client with the job's client key, pinned to the job's server key."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


class ZapHandler:
    """Answers the ZAP requests of every server socket of one context; poll :attr:`sock`."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._allowed = keys.client_public_raw
        self.denied = 0
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)  # before any server socket binds: none runs unguarded

    def on_readable(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        # version, request id, domain, peer address, routing id, mechanism, credentials...
        if len(frames) < 6:  # libzmq builds these requests: never expected
            return [b"1.0", frames[1] if len(frames) > 1 else b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _routing_id, mechanism, *credentials = frames
        ok = (
            version == b"1.0"
            and mechanism == b"CURVE"
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], self._allowed)
        )
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"ckptd-job", b""]
        self.denied += 1
        _log_rate_limited(
            self.denied,
            "refused a %s handshake from %s: not the job's client key",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
        )
        return [b"1.0", request_id, b"400", b"not the job's client key", b"", b""]

    def close(self) -> None:
        self.sock.close(linger=0)


class HandshakeWatch:
    """Counts a server socket's connections that never authenticated; poll :attr:`sock`."""

    EVENTS = (
        zmq.EVENT_ACCEPTED
        | zmq.EVENT_DISCONNECTED
        | zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )

    def __init__(self, server: zmq.Socket, name: str) -> None:
        self.name = name
        self._server = server
        self.sock = server.get_monitor_socket(self.EVENTS)
        self.unauthenticated = 0  # handshakes libzmq refused
        self.dropped = 0  # connections closed before any handshake outcome
        self._open: dict[int, bool] = {}  # fd -> whether a handshake outcome arrived while it was open

    @property
    def rejected(self) -> int:
        return self.unauthenticated + self.dropped

    def on_readable(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self.sock.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self._open[value] = False
            elif kind == zmq.EVENT_DISCONNECTED:
                if self._open.pop(value, True) is False:
                    self.dropped += 1
                    _log_rate_limited(
                        self.dropped,
                        "%s: a connection closed before authenticating "
                        "(not ZeroMQ, or a handshake frame above the size limit)",
                        self.name,
                    )
            elif kind in _OUTCOMES:
                for fd in self._open:
                    self._open[fd] = True
                why = _OUTCOMES[kind]
                if why is not None:
                    self.unauthenticated += 1
                    if kind != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # the ZAP handler logged those
                        _log_rate_limited(self.unauthenticated, "%s: refused a connection: %s", self.name, why)

    def close(self) -> None:
        try:
            self._server.disable_monitor()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)

    def counts(self) -> dict[str, int]:
        return {"unauthenticated": self.unauthenticated, "dropped": self.dropped}
