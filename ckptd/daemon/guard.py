"""Housekeeping that must never end the daemon, and how its errors still surface.

The daemon's loop runs periodic chores on every tick (timeouts of the coordinator and of the link
to it, liveness of the ranks, memory samples, the status the metrics thread serves). An exception
in one of them used to leave the loop and end the daemon, and with it every save in flight: an
exhausted descriptor table (``EMFILE`` from psutil's ``/proc`` reads) was enough. Each chore now
runs through :meth:`InternalErrors.run`, which turns an ``Exception`` into:

- an ``ERROR`` line in the daemon's log, with the traceback, saying ``INTERNAL ERROR`` (the first
  :data:`LOG_FIRST` of each chore, then every :data:`LOG_EVERY`-th, with the count so far);
- a count per chore and the last error in ``STATUS`` (``internal_errors``: ``ckptd status`` prints
  it, Prometheus gets ``ckptd_internal_errors_total``); the test suite's daemons fail a test
  whose daemon logged one (tests/fault/single_job.py).

The other chores of the tick still run, and the next tick tries again. ``BaseException``s that are
not ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) still end the daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LOG_FIRST = 10
LOG_EVERY = 1000
MARKER = "INTERNAL ERROR"


class InternalErrors:
    """Counts of the errors of each chore, and the last one."""

    def __init__(self) -> None:
        self.by_chore: dict[str, int] = {}
        self.last = ""

    @property
    def count(self) -> int:
        return sum(self.by_chore.values())

    def run(self, chore: str, fn: Callable[[], object]) -> bool:
        """Run ``fn``; an Exception is logged and counted (see the module docstring). Returns
        whether ``fn`` completed."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - logged with its traceback and counted
            self.record(chore, exc)
            return False
        return True

    def record(self, chore: str, exc: BaseException) -> None:
        n = self.by_chore[chore] = self.by_chore.get(chore, 0) + 1
        self.last = f"{chore}: {type(exc).__name__}: {exc}"
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            log.error(
                "%s in the daemon's %s (%d so far; the daemon keeps running, but this is a bug or an "
                "exhausted resource: please report it with this traceback)",
                MARKER,
                chore,
                n,
                exc_info=exc,
            )

    def status(self) -> dict[str, Any]:
        return {"count": self.count, "by_chore": dict(self.by_chore), "last": self.last}
