"""The node daemon's Prometheus endpoint: ``GET /metrics`` on one thread, bounded in connections,
time, request size and rendering work.

prometheus_client's own server (``start_http_server``) starts a thread per connection and waits on
each one forever: about 1,000 idle connections of any local user exhausted the daemon's file
descriptors, and the daemon died. :class:`MetricsServer` serves every connection from one thread
with a selector instead:

- at most :data:`MAX_CONNECTIONS` connections are open at once; accepting one more closes the
  oldest that sent nothing yet (else the oldest): a flood can crowd out a scraper, never exhaust
  the daemon;
- each connection must send its request and take the answer within :data:`TIMEOUT_S` of its
  accept, else it is closed; a request head larger than :data:`MAX_REQUEST_NBYTES` is refused;
- the page is rendered at most once per status snapshot (``snapshot()`` returns a new object each
  time the daemon's loop refreshes it), so many scrapes cost no more CPU than one;
- the server never raises into the daemon: an error of a connection closes it, any other error
  of the thread is logged with its traceback and counted (:meth:`MetricsServer.status`, which
  ``ckptd status`` shows), and the thread goes on serving.

Order of use: :meth:`MetricsServer.bind` (raises OSError when the address is taken: the caller
says so), :meth:`~MetricsServer.start`, then :meth:`~MetricsServer.close` from the thread that
started it.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .guard import MARKER

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
TIMEOUT_S = 10.0  # a scraper's whole exchange (Prometheus' default scrape timeout is 10 s)
MAX_REQUEST_NBYTES = 8192
_ACCEPTS_PER_WAKE = 64  # a flood of connections cannot starve the others
_ACCEPT_PAUSE_S = 1.0  # after accept() failed for want of descriptors or memory
_LOG_FIRST = 10
_LOG_EVERY = 1000
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text format 0.0.4


def http_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8", head: bool = False) -> bytes:
    header = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return header if head else header + body


def answer(request_head: bytes, page: Callable[[], bytes]) -> bytes:
    """The whole HTTP response to a request head (its lines up to the blank line)."""
    line = request_head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return _response("400 Bad Request", b"bad request\n")
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if method not in (b"GET", b"HEAD"):
        return _response("405 Method Not Allowed", b"only GET /metrics\n")
    if target not in (b"/metrics", b"/"):
        return _response("404 Not Found", b"only /metrics\n")
    return _response("200 OK", page(), CONTENT_TYPE, head=method == b"HEAD")


@dataclass
class _Conn:
    sock: socket.socket
    deadline_s: float
    received: bytearray = field(default_factory=bytearray)
    outgoing: memoryview | None = None


class MetricsServer:
    """Serves ``render(snapshot())`` as ``GET /metrics`` (see the module docstring)."""

    def __init__(self, listener: socket.socket, url: str, snapshot: Callable[[], Any], render: Callable[[Any], bytes]):
        self._listener = listener
        self.url = url
        self._snapshot = snapshot
        self._render = render
        self._page: tuple[int, bytes] | None = None  # (id of the snapshot rendered, page)
        self._sel = selectors.DefaultSelector()
        self._conns: collections.OrderedDict[int, _Conn] = collections.OrderedDict()  # by fd, oldest first
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._accept_paused_until: float | None = None
        self.counts = {"accepted": 0, "served": 0, "dropped": 0, "timed_out": 0, "refused": 0, "errors": 0}
        self.last_error = ""

    @classmethod
    def bind(cls, host: str, port: int, snapshot: Callable[[], Any], render: Callable[[Any], bytes]) -> MetricsServer:
        """A server listening on ``host:port`` (not serving yet); OSError when the address cannot
        be bound (another process holds the port, no such local address...)."""
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # A restarted daemon rebinds at once despite its predecessor's TIME_WAIT connections;
            # Linux still refuses a port another socket listens on (so a squatter is noticed).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(128)  # waiting in the kernel costs the daemon no descriptor
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return cls(sock, http_url(host, sock.getsockname()[1]), snapshot, render)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def start(self) -> None:
        """Serve from a thread of its own."""
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, name="ckptd-metrics", daemon=True)
        self._thread.start()

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "serving": True, "connections": len(self._conns), **self.counts}

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("the metrics thread did not stop within %.0f s", timeout_s)
                return  # it still uses the sockets; the process exits soon
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._listener.close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    # --- the server thread --------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop:
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - never into the daemon; logged and counted
                self._error(exc)
                time.sleep(0.05)  # a persistent error must not spin

    def _error(self, exc: BaseException) -> None:
        self.counts["errors"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        n = self.counts["errors"]
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            log.error("%s in the metrics server (%d so far); it keeps serving", MARKER, n, exc_info=exc)

    def _step(self) -> None:
        now = time.monotonic()
        deadlines = [c.deadline_s for c in self._conns.values()]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, events in self._sel.select(timeout):
            if key.data is None:
                self._accept()
            elif key.data == "wake":
                try:
                    self._wake_r.recv(64)
                except BlockingIOError:
                    pass
            else:
                self._on_event(key.data, events)
        self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: stop accepting for a moment rather than spin
                self._sel.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + _ACCEPT_PAUSE_S
                self._error(exc)
                return
            self.counts["accepted"] += 1
            while len(self._conns) >= MAX_CONNECTIONS:
                self.counts["dropped"] += 1
                self._drop(self._victim())
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + TIMEOUT_S)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _victim(self) -> _Conn:
        """The connection to close for a new one: the oldest that sent nothing yet, else the oldest."""
        idle = (c for c in self._conns.values() if not c.received and c.outgoing is None)
        return next(idle, None) or next(iter(self._conns.values()))

    def _on_event(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ and conn.outgoing is None:
                self._read(conn)
            if conn.outgoing is not None and conn.sock.fileno() >= 0:
                self._write(conn, conn.outgoing)
        except OSError:  # reset by the peer, or the like: that connection only
            self._drop(conn)

    def _read(self, conn: _Conn) -> None:
        data = conn.sock.recv(4096)
        if not data:
            self._drop(conn)
            return
        conn.received += data
        end = conn.received.find(b"\r\n\r\n")
        if end < 0:
            end = conn.received.find(b"\n\n")
        if end < 0:
            if len(conn.received) > MAX_REQUEST_NBYTES:
                self.counts["refused"] += 1
                self._reply(conn, _response("431 Request Header Fields Too Large", b"request too large\n"))
            return
        reply = answer(bytes(conn.received[:end]), self._current_page)
        if not reply.startswith(b"HTTP/1.1 200"):
            self.counts["refused"] += 1
        self._reply(conn, reply)

    def _current_page(self) -> bytes:
        snap = self._snapshot()
        if self._page is None or self._page[0] != id(snap):
            self._page = (id(snap), self._render(snap))
        return self._page[1]

    def _reply(self, conn: _Conn, data: bytes) -> None:
        conn.outgoing = memoryview(data)
        self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def _write(self, conn: _Conn, outgoing: memoryview) -> None:
        sent = conn.sock.send(outgoing)
        conn.outgoing = outgoing[sent:]
        if not conn.outgoing:
            self.counts["served"] += 1
            self._drop(conn)

    def _expire(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        for conn in [c for c in self._conns.values() if c.deadline_s <= now]:
            self.counts["timed_out"] += 1
            self._drop(conn)

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        self._conns.pop(fd, None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
