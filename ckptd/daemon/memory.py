"""What checkpointing costs the node in memory, as the daemon sees it: current and peak.

Sampled by the daemon's loop once per heartbeat (:meth:`MemoryWatch.sample`) and reported in
``STATUS`` (``ckptd status``, the Prometheus metrics):

- the daemon's own resident memory (its peak exactly, from ``getrusage``);
- each connected rank's resident memory (its peak as sampled: a rank's process is the trainer's,
  so this is what training plus staging take, not ckptd alone);
- the pages of ``/dev/shm`` the ranks' staging rings hold (``st_blocks`` of the segments: a ring
  is sparse until the producer writes it), and ``/dev/shm`` as a whole (every user's files).

Peaks of sampled values may miss a spike shorter than a heartbeat; ``ckptd bench`` samples its
own processes faster (benchmarks.memory).
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..staging.segment import SHM_DIR, allocated_nbytes


@dataclass
class Peak:
    """A sampled quantity in bytes: its last value and the largest seen."""

    current: int = 0
    peak: int = 0

    def update(self, nbytes: int) -> None:
        self.current = nbytes
        self.peak = max(self.peak, nbytes)

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak}


@dataclass
class RankMemory:
    rank: int
    pid: int
    rss: Peak = field(default_factory=Peak)


class MemoryWatch:
    """Current and peak memory of the daemon, its ranks, their staging rings and ``/dev/shm``."""

    def __init__(self) -> None:
        self.daemon_rss = Peak()
        self.ranks: dict[int, RankMemory] = {}  # by pid
        self.staging = Peak()  # /dev/shm pages held by this node's staging rings
        self.dev_shm = Peak()  # /dev/shm used, by anyone
        self.dev_shm_nbytes = 0
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, ranks: Iterable[tuple[int, int]], ring_paths: Iterable[str]) -> None:
        """One sample: ``ranks`` as ``(rank, pid)`` of the connected ranks, ``ring_paths`` the
        segments of the live staging rings."""
        self.daemon_rss.update(psutil.Process().memory_info().rss)
        self.daemon_rss.peak = max(self.daemon_rss.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        live = dict(ranks)
        for pid in list(self.ranks):
            if pid not in live.values():
                del self.ranks[pid]
                self._procs.pop(pid, None)
        for rank, pid in live.items():
            rss = self._rss(pid)
            if rss is not None:
                self.ranks.setdefault(pid, RankMemory(rank, pid)).rss.update(rss)
        self.staging.update(sum(_allocated_nbytes(p) for p in ring_paths))
        usage = psutil.disk_usage(SHM_DIR)
        self.dev_shm.update(usage.used)
        self.dev_shm_nbytes = usage.total

    def _rss(self, pid: int) -> int | None:
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
            return int(proc.memory_info().rss)
        except psutil.Error:
            self._procs.pop(pid, None)
            return None

    def report(self) -> dict[str, Any]:
        return {
            "daemon_rss": self.daemon_rss.as_dict(),
            "ranks_rss": [
                {"rank": r.rank, "pid": r.pid, **r.rss.as_dict()}
                for r in sorted(self.ranks.values(), key=lambda r: r.rank)
            ],
            "staging_shm": self.staging.as_dict(),
            "dev_shm": {**self.dev_shm.as_dict(), "size": self.dev_shm_nbytes},
        }


def _allocated_nbytes(path: str) -> int:
    try:
        return allocated_nbytes(path)
    except OSError:  # unlinked since (its rank retired it)
        return 0
