"""Per-save measurements a rank keeps, and their summary (:meth:`Checkpointer.stats`).

For every save the rank knows: how long ``save()`` blocked training (``stall_s``, of which
``queue_wait_s`` waiting for staging ring space, ``plan_s`` planning, ``copy_s`` starting the
snapshot and ``handoff_s`` the daemon's round trip), how many bytes it staged, how long the
daemon took to write and fsync its data file (``persist_s``) and how long after ``save()``
returned the outcome arrived (``commit_latency_s``). Those are the inputs of save-frequency
tuning (:mod:`ckptd.tune`).
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any

RECENT_SAVES = 100


@dataclass
class SaveRecord:
    step: int
    nbytes: int
    stall_s: float
    queue_wait_s: float
    # Where the rest of the stall went: planning (the state dict taken apart, or the last plan
    # reused), the snapshot's start (the copy into the ring, a fork, a device snapshot, a lazy
    # snapshot's version record), and the SAVE's round trip to the node daemon (which checks its
    # item list: the whole list at a first save, only its id after).
    plan_s: float = 0.0
    copy_s: float = 0.0
    handoff_s: float = 0.0
    persist_s: float | None = None  # daemon write + fsync of this rank's file (WRITE_DONE)
    write_queue_s: float | None = None  # the write's wait for a daemon writer thread
    snapshot_s: float | None = None  # then its wait for the snapshot child's copy (fork snapshots)
    commit_latency_s: float | None = None  # save() returned -> COMMITTED known on this rank
    status: str = "pending"


def _summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"last": values[-1], "mean": sum(values) / len(values), "max": max(values)}


@dataclass
class SaveStats:
    """Counters since the Checkpointer opened, plus the most recent saves (newest last)."""

    saves: int = 0
    committed: int = 0
    aborted: int = 0
    skipped: int = 0
    staged_nbytes: int = 0
    recent: collections.deque[SaveRecord] = field(default_factory=lambda: collections.deque(maxlen=RECENT_SAVES))

    def add(self, record: SaveRecord) -> None:
        self.saves += 1
        self.staged_nbytes += record.nbytes
        self.recent.append(record)

    def finished(self, record: SaveRecord, status: str) -> None:
        record.status = status
        if status == "committed":
            self.committed += 1
        elif status == "aborted":
            self.aborted += 1
        elif status == "skipped":
            self.skipped += 1

    def as_dict(self) -> dict[str, Any]:
        """Counters, last/mean/max of each timing over the recent saves, and the recent records."""
        recs = list(self.recent)

        def col(name: str) -> dict[str, float] | None:
            return _summary([v for v in (getattr(r, name) for r in recs) if v is not None])

        return {
            "saves": self.saves,
            "committed": self.committed,
            "aborted": self.aborted,
            "skipped": self.skipped,
            "pending": sum(r.status == "pending" for r in recs),
            "staged_nbytes": self.staged_nbytes,
            "stall_s": col("stall_s"),
            "queue_wait_s": col("queue_wait_s"),
            "plan_s": col("plan_s"),
            "copy_s": col("copy_s"),
            "handoff_s": col("handoff_s"),
            "persist_s": col("persist_s"),
            "commit_latency_s": col("commit_latency_s"),
            "recent": [asdict(r) for r in recs],
        }
