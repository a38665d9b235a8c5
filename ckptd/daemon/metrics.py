"""What a node daemon measures: writes, bytes, persist and commit latencies, rejected input.

The daemon's event loop updates a :class:`DaemonMetrics`; ``STATUS`` replies carry its
:meth:`~DaemonMetrics.snapshot`, and :func:`prometheus_text` renders a snapshot in the Prometheus
text exposition format (served over HTTP when ``CKPTD_METRICS_PORT`` is set, and printed by
``ckptd status --prometheus``). A lock guards the counters because the HTTP server reads them
from its own thread.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

RECENT = 32  # per-step records kept for STATUS


@dataclass
class StepTiming:
    """One step on this node: when its first SAVE arrived, its writes finished, it resolved."""

    step: int
    first_save_s: float
    ranks: int = 0
    nbytes: int = 0
    write_s: float = 0.0  # sum over this node's rank files
    queue_s: float = 0.0  # longest wait of a write for a writer thread
    persisted_s: float | None = None  # first SAVE -> last write durable
    outcome: str = "pending"
    commit_s: float | None = None  # first SAVE -> COMMITTED/ABORTED known here

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ranks": self.ranks, "nbytes": self.nbytes,
                "write_s": round(self.write_s, 6), "queue_s": round(self.queue_s, 6),
                "persist_s": None if self.persisted_s is None else round(self.persisted_s, 6),
                "outcome": self.outcome,
                "commit_s": None if self.commit_s is None else round(self.commit_s, 6)}


@dataclass
class DaemonMetrics:
    started_s: float = field(default_factory=time.monotonic)
    writes_ok: int = 0
    writes_failed: int = 0
    bytes_written: int = 0
    write_s_total: float = 0.0
    steps_committed: int = 0
    steps_aborted: int = 0
    saves_received: int = 0
    recent: collections.OrderedDict[int, StepTiming] = field(default_factory=collections.OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def save_received(self, step: int) -> None:
        with self.lock:
            self.saves_received += 1
            if step not in self.recent:
                self.recent[step] = StepTiming(step, time.monotonic())
                while len(self.recent) > RECENT:
                    self.recent.popitem(last=False)

    def write_finished(self, step: int, nbytes: int, write_s: float, queue_s: float, ok: bool) -> None:
        with self.lock:
            if ok:
                self.writes_ok += 1
                self.bytes_written += nbytes
                self.write_s_total += write_s
            else:
                self.writes_failed += 1
            st = self.recent.get(step)
            if st is not None:
                st.ranks += 1
                st.nbytes += nbytes if ok else 0
                st.write_s += write_s
                st.queue_s = max(st.queue_s, queue_s)
                st.persisted_s = time.monotonic() - st.first_save_s

    def resolved(self, step: int, committed: bool) -> None:
        with self.lock:
            if committed:
                self.steps_committed += 1
            else:
                self.steps_aborted += 1
            st = self.recent.get(step)
            if st is not None and st.outcome == "pending":
                st.outcome = "committed" if committed else "aborted"
                st.commit_s = time.monotonic() - st.first_save_s

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            done = [s for s in self.recent.values() if s.outcome == "committed"]
            last = done[-1].as_dict() if done else None
            return {
                "uptime_s": round(time.monotonic() - self.started_s, 3),
                "saves_received": self.saves_received,
                "writes_ok": self.writes_ok,
                "writes_failed": self.writes_failed,
                "bytes_written": self.bytes_written,
                "write_s_total": round(self.write_s_total, 6),
                "write_bytes_per_s": round(self.bytes_written / self.write_s_total, 1) if self.write_s_total else None,
                "steps_committed": self.steps_committed,
                "steps_aborted": self.steps_aborted,
                "last_committed": last,
                "recent_steps": [s.as_dict() for s in self.recent.values()],
            }


# (name, type, help, key in the snapshot)
_SERIES: tuple[tuple[str, str, str, str], ...] = (
    ("ckptd_saves_received_total", "counter", "SAVE requests received from ranks", "saves_received"),
    ("ckptd_writes_total", "counter", "rank data files written and fsynced", "writes_ok"),
    ("ckptd_write_failures_total", "counter", "rank data files whose write failed", "writes_failed"),
    ("ckptd_written_bytes_total", "counter", "bytes written to data files", "bytes_written"),
    ("ckptd_write_seconds_total", "counter", "time spent writing data files", "write_s_total"),
    ("ckptd_steps_committed_total", "counter", "steps this node saw committed", "steps_committed"),
    ("ckptd_steps_aborted_total", "counter", "steps this node saw aborted", "steps_aborted"),
)


def _values(status: dict[str, Any]) -> dict[str, Any]:
    m = status.get("metrics", {})
    last = m.get("last_committed") or {}
    values = {name: m.get(key) for name, _, _, key in _SERIES}
    values.update({
        "ckptd_writes_in_flight": status.get("jobs_in_flight"),
        "ckptd_steps_pending": len(status.get("pending_steps", [])),
        "ckptd_rejected_messages_total": status.get("rejected_messages"),
        "ckptd_last_persist_seconds": last.get("persist_s"),
        "ckptd_last_commit_seconds": last.get("commit_s"),
        "ckptd_last_committed_step": last.get("step"),
    })
    return values


_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("ckptd_writes_in_flight", "gauge", "data-file writes queued or running"),
    ("ckptd_steps_pending", "gauge", "steps written here awaiting the coordinator"),
    ("ckptd_rejected_messages_total", "counter",
     "messages and connections rejected on the ranks' socket and the coordinator's port (malformed, "
     "oversized, duplicate, unauthenticated handshakes, dropped before authenticating)"),
    ("ckptd_last_persist_seconds", "gauge", "first SAVE to last data file durable, newest committed step"),
    ("ckptd_last_commit_seconds", "gauge", "first SAVE to COMMITTED, newest committed step"),
    ("ckptd_last_committed_step", "gauge", "newest step this node saw committed"),
)


def _number(value: Any) -> str:
    x = float(value)
    return str(int(x)) if x.is_integer() else repr(x)


def prometheus_text(statuses: list[dict[str, Any]]) -> str:
    """Render daemon ``STATUS`` replies (one per node) in the Prometheus text exposition format."""
    per_node = [(f'job="{st.get("job", "")}",node="{st.get("node", 0)}"', _values(st)) for st in statuses]
    out: list[str] = []
    for name, kind, help_text in [(n, k, h) for n, k, h, _ in _SERIES] + list(_GAUGES):
        samples = [f"{name}{{{labels}}} {_number(v[name])}" for labels, v in per_node if v.get(name) is not None]
        if samples:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(out) + "\n"


def serve_metrics(port: int, status: Callable[[], dict[str, Any]]) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` on 127.0.0.1:``port`` from a daemon thread; returns the server."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served")
                return
            body = prometheus_text([status()]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep scrapes out of the log
            return

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ckptd-metrics", daemon=True).start()
    return server
