"""A rank's fork snapshot children (ckptd.staging.fork) until they are reaped: how many may wait
for ring space, and how closing ends them within its deadline.

Order of use, on the training thread: :meth:`SnapshotChildren.fork` a save's child (after
:meth:`~SnapshotChildren.wait_turn`: at most one child per rank waits for ring space, see
:func:`ckptd.staging.backpressure.may_fork`); its :class:`ForkProducer` adds it to the children
once the daemon took the save (or may have); :meth:`~SnapshotChildren.reap` now and then (never
blocks), :meth:`~SnapshotChildren.close` when the Checkpointer closes: children still running at
its deadline are killed. A snapshot child only copies the trainer's memory into the ring
(``pwrite``, no file, no socket), so killing it fails its save and nothing else: the daemon sees
it exit unsealed (ckptd.daemon.snapshot).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import StagingError
from .backpressure import may_fork
from .fork import fork_into, reap
from .producer import Claim, Snapshot
from .rankside import StagingRing

log = logging.getLogger(__name__)

# After SIGKILL, how long close() waits for the killed children to be reaped (a child killed
# while the kernel serves it, e.g. a page fault on a slow swap, exits once that returns).
KILL_REAP_S = 1.0
_POLL_S = 0.01


@dataclass(frozen=True)
class Child:
    pid: int
    end: int  # virtual end of the save it produces (ckptd.staging.ring)


class SnapshotChildren:
    """This rank's snapshot children not reaped yet, with the ends of their saves in the ring."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._live: list[Child] = []

    def __len__(self) -> int:
        return len(self._live)

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._live]

    def add(self, pid: int, end: int) -> None:
        self._live.append(Child(pid, end))

    def reap(self) -> None:
        """Collect the children that exited (never blocks)."""
        if self._live:
            running = set(reap(self.pids, block=False))
            self._live = [c for c in self._live if c.pid in running]

    def fork(
        self, ring: StagingRing, claim: Claim, daemon_pid: int, idle: Callable[[float], None]
    ) -> tuple[ForkProducer | None, float]:
        """Fork the snapshot child of the claimed save once it is its turn (:meth:`wait_turn`, up
        to the ring's ``snapshot_timeout_s``); its producer (None: no child started, the caller
        produces the save itself) and the seconds waited for the turn."""
        waited = self.wait_turn(ring.writer.consumed, ring.capacity, claim.end, ring.writer.timeout_s, idle)
        if waited > 0.01:
            log.info("rank %d: waited %.3f s for an earlier snapshot to get its ring space", self.rank, waited)
        # The child runs at the trainer's priority, not niced like the daemon: every page the
        # trainer writes while the child lives is copied, so a child that yields costs the trainer
        # more than it gives (2 GiB rewritten every step, a save every 4: +127 % loop time with the
        # child at nice 10, +108 % at 0, on the 2-core CI machine).
        snap = fork_into(ring, claim, 0, daemon_pid)
        return (None if snap is None else ForkProducer(self, snap, claim.end)), waited

    def wait_turn(
        self,
        consumed: Callable[[], int],
        capacity: int,
        end: int,
        timeout_s: float,
        idle: Callable[[float], None],
    ) -> float:
        """Return once the child of a save ending at ``end`` may be forked (see
        :func:`~ckptd.staging.backpressure.may_fork`); the seconds waited. ``consumed`` reads the
        ring's header, ``idle(s)`` waits up to ``s`` seconds for the daemon's notifications (and
        raises if the daemon died). Raises StagingError after ``timeout_s``: an earlier child
        waits that long at most before it gives up, so the daemon is not persisting."""
        t0 = time.monotonic()
        while True:
            self.reap()
            if may_fork(consumed=consumed(), capacity=capacity, end=end, earlier_ends=(c.end for c in self._live)):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise StagingError(
                    f"rank {self.rank}: the node daemon made no room in the staging ring for "
                    f"{timeout_s:g} s (CKPTD_SNAPSHOT_TIMEOUT_S) while snapshot process(es) "
                    f"{self.pids} waited for it; the node daemon is not persisting: see its log"
                )
            idle(0.05)

    def close(self, deadline: float) -> None:
        """Reap every child, waiting for them until ``deadline`` (monotonic); kill those still
        running then (their saves fail) and wait up to :data:`KILL_REAP_S` more for them."""
        while self._live and time.monotonic() < deadline:
            self.reap()
            if self._live:
                time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))
        if not self._live:
            return
        killed = self.pids
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.warning(
            "rank %d: snapshot process(es) %s still copying into the staging ring (or waiting for "
            "room in it) when close() ran out of time: killed, their saves fail",
            self.rank,
            killed,
        )
        give_up = time.monotonic() + KILL_REAP_S
        while self._live and time.monotonic() < give_up:
            self.reap()
            if self._live:
                time.sleep(_POLL_S)
        if self._live:
            log.warning("rank %d: killed snapshot process(es) %s not reaped yet; left behind", self.rank, self.pids)
            self._live = []


class ForkProducer:
    """A :class:`~ckptd.staging.producer.Producer` that is a forked snapshot child
    (ckptd.staging.fork), copying while training goes on; :class:`SnapshotChildren` reaps it."""

    def __init__(self, children: SnapshotChildren, snapshot: Snapshot, end: int) -> None:
        self.children = children
        self.snapshot = snapshot
        self.end = end

    def after_ack(self) -> float:
        # Reaped only from now on: the daemon holds a pidfd of the child, so its pid cannot be reused.
        self.children.add(self.snapshot.pid, self.end)
        return 0.0

    def cancel(self) -> None:
        # The daemon never took the save: its copy serves nothing, and a child waiting for ring room
        # that the daemon will never free would hold save() up to snapshot_timeout_s. Killed, then
        # reaped (an unreaped child's pid is not reused), before the ring range is given back.
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.snapshot.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.snapshot.pid, 0)

    def detach(self) -> None:
        self.children.add(self.snapshot.pid, self.end)
