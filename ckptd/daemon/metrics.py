"""What a node daemon measures: writes, bytes, persist and commit latencies, rejected input.

The daemon's event loop updates a :class:`DaemonMetrics`; ``STATUS`` replies carry its
:meth:`~DaemonMetrics.snapshot`, and :class:`StatusCollector` turns STATUS replies into
Prometheus metric families (prometheus_client renders them: served over HTTP by
ckptd.daemon.metrics_http when ``CKPTD_METRICS_PORT`` is set, and printed by ``ckptd status
--prometheus``). A lock guards the counters because writer threads report into them.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
        return {
            "step": self.step,
            "ranks": self.ranks,
            "nbytes": self.nbytes,
            "write_s": round(self.write_s, 6),
            "queue_s": round(self.queue_s, 6),
            "persist_s": None if self.persisted_s is None else round(self.persisted_s, 6),
            "outcome": self.outcome,
            "commit_s": None if self.commit_s is None else round(self.commit_s, 6),
        }


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


# (name, help, key in the snapshot); prometheus_client adds ``_total`` to counters.
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("ckptd_saves_received", "SAVE requests received from ranks", "saves_received"),
    ("ckptd_writes", "rank data files written and fsynced", "writes_ok"),
    ("ckptd_write_failures", "rank data files whose write failed", "writes_failed"),
    ("ckptd_written_bytes", "bytes written to data files", "bytes_written"),
    ("ckptd_write_seconds", "time spent writing data files", "write_s_total"),
    ("ckptd_steps_committed", "steps this node saw committed", "steps_committed"),
    ("ckptd_steps_aborted", "steps this node saw aborted", "steps_aborted"),
)
_GAUGES: tuple[tuple[str, str], ...] = (
    ("ckptd_writes_in_flight", "data-file writes queued or running"),
    ("ckptd_steps_pending", "steps written here awaiting the coordinator"),
    ("ckptd_last_persist_seconds", "first SAVE to last data file durable, newest committed step"),
    ("ckptd_last_commit_seconds", "first SAVE to COMMITTED, newest committed step"),
    ("ckptd_last_committed_step", "newest step this node saw committed"),
    ("ckptd_daemon_rss_bytes", "resident memory of the node daemon"),
    ("ckptd_daemon_rss_peak_bytes", "peak resident memory of the node daemon"),
    ("ckptd_staging_shm_bytes", "/dev/shm pages held by the staging rings of this node's ranks"),
    ("ckptd_staging_shm_peak_bytes", "peak /dev/shm pages held by the staging rings (sampled)"),
    ("ckptd_dev_shm_used_bytes", "/dev/shm in use on this node, by anyone"),
    ("ckptd_dev_shm_used_peak_bytes", "peak /dev/shm in use on this node (sampled)"),
)
_INTERNAL_ERRORS = (
    "ckptd_internal_errors",
    "errors of the daemon's own housekeeping and metrics server, logged with their traceback: a bug "
    "or an exhausted resource (the daemon keeps running)",
)
_REJECTED = (
    "ckptd_rejected_messages",
    "messages and connections rejected on the ranks' socket and the coordinator's port "
    "(malformed, oversized, duplicate, reports addressed to another coordinator instance, "
    "unauthenticated handshakes, dropped before authenticating)",
)


def _gauge_values(status: dict[str, Any]) -> dict[str, Any]:
    last = status.get("metrics", {}).get("last_committed") or {}
    mem = status.get("memory", {})
    peak = lambda key, part: (mem.get(key) or {}).get(part)  # noqa: E731
    return {
        "ckptd_writes_in_flight": status.get("jobs_in_flight"),
        "ckptd_steps_pending": len(status.get("pending_steps", [])),
        "ckptd_last_persist_seconds": last.get("persist_s"),
        "ckptd_last_commit_seconds": last.get("commit_s"),
        "ckptd_last_committed_step": last.get("step"),
        "ckptd_daemon_rss_bytes": peak("daemon_rss", "current"),
        "ckptd_daemon_rss_peak_bytes": peak("daemon_rss", "peak"),
        "ckptd_staging_shm_bytes": peak("staging_shm", "current"),
        "ckptd_staging_shm_peak_bytes": peak("staging_shm", "peak"),
        "ckptd_dev_shm_used_bytes": peak("dev_shm", "current"),
        "ckptd_dev_shm_used_peak_bytes": peak("dev_shm", "peak"),
    }


class StatusCollector(Collector):
    """Metric families of daemon ``STATUS`` replies (one per node), labelled by job and node;
    ``statuses`` is called at every scrape."""

    def __init__(self, statuses: Callable[[], list[dict[str, Any]]]) -> None:
        self.statuses = statuses

    def collect(self) -> Iterator[Metric]:
        statuses = self.statuses()
        labels = ["job", "node"]
        keyed = [([str(st.get("job", "")), str(st.get("node", 0))], st) for st in statuses]
        for name, help_text, key in _COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=labels)
            for values, st in keyed:
                value = st.get("metrics", {}).get(key)
                if value is not None:
                    family.add_metric(values, value)
            yield family
        rejected = CounterMetricFamily(*_REJECTED, labels=labels)
        for values, st in keyed:
            if st.get("rejected_messages") is not None:
                rejected.add_metric(values, st["rejected_messages"])
        yield rejected
        internal = CounterMetricFamily(*_INTERNAL_ERRORS, labels=labels)
        for values, st in keyed:
            if st.get("internal_errors") is not None:
                internal.add_metric(values, st["internal_errors"]["count"])
        yield internal
        gauges = [(values, _gauge_values(st)) for values, st in keyed]
        for name, help_text in _GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            for values, found in gauges:
                if found[name] is not None:
                    gauge.add_metric(values, found[name])
            yield gauge
        ranks = GaugeMetricFamily(
            "ckptd_rank_rss_bytes",
            "resident memory of a connected rank's process (training and staging), as last sampled",
            labels=[*labels, "rank"],
        )
        for values, st in keyed:
            for r in st.get("memory", {}).get("ranks_rss", []):
                ranks.add_metric([*values, str(r["rank"])], r["current"])
        yield ranks


def _registry(statuses: Callable[[], list[dict[str, Any]]]) -> CollectorRegistry:
    # A registry of its own: nothing process-global (prometheus_client's default registry also
    # holds process and GC metrics of whoever imports it).
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(statuses))
    return registry


def prometheus_text(statuses: list[dict[str, Any]]) -> str:
    """Render daemon ``STATUS`` replies (one per node) in the Prometheus text exposition format."""
    return generate_latest(_registry(lambda: statuses)).decode()


def render_status(status: dict[str, Any]) -> bytes:
    """One daemon's ``STATUS`` as the page its metrics endpoint serves."""
    return generate_latest(_registry(lambda: [status]))
