"""Watching the producer of a rank's save (a snapshot child, ckptd.staging.fork, or the rank
itself) while the daemon writes the save from the rank's staging ring.

A SAVE whose shards are copied by a forked child names the child's pid and the seal it writes
after its last copy. The daemon opens a pidfd for the child when the SAVE arrives (the rank reaps
the child only after the SAVE was acknowledged, so the pid cannot have been reused by then). The
child publishes its progress after each copy, so the writer thread writes each item as soon as
its bytes are complete (copy and disk write overlap), and before the file is published it
checks the seal. No seal: the child died before it finished, and the save fails with that reason
instead of persisting half-copied shards. The daemon waits only on a child of the rank's own
process created after the rank registered the ring, or on the rank's process itself for a lazy
snapshot (:func:`check_snapshot_child`): a connection cannot make a writer wait on any other
process.
"""

from __future__ import annotations

import bisect
import enum
import logging
import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import StagingError
from ..procid import CLOCK_TICK_S, read_stat, same_process, start_ticks_of
from ..staging.ring import (
    ABANDONED,
    ALIGN,
    BLOCKS,
    NO_ROOM,
    SEAL_NBYTES,
    RingMap,
    block_offset,
)
from ..staging.segment import shm_free_nbytes

# Without pidfds (Linux < 5.3), how often /proc is polled for the child's exit.
_POLL_S = 0.005
# How long a snapshot child killed by the daemon (SIGKILL) gets to be gone.
KILLED_EXIT_S = 10.0

log = logging.getLogger(__name__)


def boottime_s() -> float:
    """Now on the clock process start times count on (seconds since boot, CLOCK_BOOTTIME)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def check_snapshot_child(rank: int, pid: int, parent_pid: int, not_before_s: float) -> None:
    """Raise StagingError unless ``pid`` is a child of ``parent_pid`` (the rank's process) started
    after ``not_before_s`` (its ring's registration, :func:`boottime_s`), or the rank's process
    itself (a lazy snapshot, copied by a thread of the rank: ckptd.staging.lazy). A child that is
    gone already passes: there is nothing to wait on, and its seal in the ring tells whether it
    finished."""
    if pid == parent_pid:
        return
    # Start ticks since boot (ckptd.procid), not psutil's create_time(): that adds the
    # boot time of /proc/stat in whole seconds, which can be off by up to a second against the
    # ring's registration and moves when the wall clock is stepped.
    try:
        st = read_stat(pid)
    except OSError as exc:
        raise StagingError(f"rank {rank}: cannot inspect snapshot process {pid}: {exc}") from None
    if st is None:
        return
    ppid, started_s = st.ppid, st.started_s
    if ppid != parent_pid:
        raise StagingError(
            f"rank {rank}: snapshot process {pid} is not a child of the rank's process "
            f"{parent_pid}; the daemon waits only on the rank's own snapshot"
        )
    if started_s + CLOCK_TICK_S < not_before_s:  # start times are truncated to a clock tick
        raise StagingError(
            f"rank {rank}: snapshot process {pid} is older than the rank's staging ring; "
            "the daemon waits only on a snapshot of this save"
        )


class ExitWatch(enum.Enum):
    """How the daemon learns that a producer process exited."""

    PIDFD = "pidfd"  # a pidfd becomes readable (Linux >= 5.3)
    POLL = "poll"  # no pidfd support: its state is polled
    GONE = "gone"  # exited and reaped already, or the watch is closed: its seal alone tells


@dataclass
class SnapshotWait:
    """The daemon's watch over the producer of one save: its progress and seal in the save's
    control block of the rank's ring (ckptd.staging.ring), and the producing process."""

    rank: int
    pid: int
    seal: bytes
    block: int
    exit_watch: ExitWatch = ExitWatch.GONE
    pidfd: int = -1  # with ExitWatch.PIDFD
    waited_s: float = 0.0  # time spent waiting for the producer, in total
    child: bool = False  # a snapshot child of the rank (ckptd.staging.fork), not the rank itself
    # With ExitWatch.POLL: the producer's start time, so that a later process given its pid is
    # neither waited on nor killed.
    start_ticks: int | None = None

    @classmethod
    def open(cls, rank: int, pid: int, seal: bytes, seal_offset: int, *, child: bool = False) -> SnapshotWait:
        """Watch the producer ``pid`` of a save sealed with ``seal`` in the control block at
        ``seal_offset``; ``child``: ``pid`` is a snapshot child of the rank (checked by
        :func:`check_snapshot_child`), which :meth:`drain` may kill."""
        blocks = {block_offset(b): b for b in range(BLOCKS)}
        if pid <= 1 or len(seal) != SEAL_NBYTES or seal_offset not in blocks:
            raise StagingError(
                f"rank {rank}: malformed snapshot (pid {pid}, seal of {len(seal)} bytes "
                f"at header offset {seal_offset}, not a control block)"
            )
        wait = cls(rank, pid, seal, blocks[seal_offset], child=child)
        try:
            wait.pidfd, wait.exit_watch = os.pidfd_open(pid), ExitWatch.PIDFD
        except ProcessLookupError:
            pass  # exited and reaped already (its trainer died): the seal tells whether it finished
        except (AttributeError, OSError):
            wait.start_ticks = start_ticks_of(pid)
            wait.exit_watch = ExitWatch.POLL if wait.start_ticks is not None else ExitWatch.GONE
        return wait

    def close(self) -> None:
        if self.exit_watch is ExitWatch.PIDFD:
            os.close(self.pidfd)
            self.pidfd = -1
        self.exit_watch = ExitWatch.GONE

    def progress(self, ring: RingMap) -> int:
        """The virtual end of what the producer has written (every byte below it is final);
        raises StagingError if it will never seal the save."""
        done = ring.progress(self.block)
        if done == NO_ROOM:
            raise StagingError(
                f"rank {self.rank}'s snapshot ran out of room: /dev/shm has {shm_free_nbytes()} bytes free; "
                "this save is not persisted; training goes on and the next save retries. Free or "
                "enlarge /dev/shm (containers: --shm-size), or lower CKPTD_STAGING_BUDGET"
            )
        if done == ABANDONED:
            raise StagingError(
                f"rank {self.rank} abandoned its snapshot of this save (a tensor copied lazily was "
                "modified before the fence, or the copy failed: the rank's log says which), so it is "
                "not persisted. With snapshot=lazy, call Checkpointer.before_update() (or "
                "attach(optimizer)) before changing saved tensors"
            )
        return done

    def sealed(self, ring: RingMap) -> bool:
        self.progress(ring)  # an abandoned snapshot is never sealed: raise now
        return ring.sealed_with(self.block) == self.seal

    def wait_for(self, ring: RingMap, end: int, timeout_s: float) -> None:
        """Return once the virtual bytes below ``end`` are produced; raise StagingError if the
        producer exited (or ran past ``timeout_s``) without producing them."""
        self._until(ring, lambda: self.progress(ring) >= end, timeout_s)

    def wait(self, ring: RingMap, timeout_s: float) -> None:
        """Return once the producer has written everything and sealed the save (the pidfd is then
        closed); raise StagingError otherwise, with the watch still open for :meth:`drain`, which
        must tell a child still running (to kill it) from one that exited."""
        self._until(ring, lambda: self.sealed(ring), timeout_s)
        self.close()

    def drain(
        self, ring: RingMap, end: int, timeout_s: float, starts: Sequence[int] = (), ends: Sequence[int] = ()
    ) -> bool:
        """After a failed write, free this save's ring space as its producer goes: follow its
        progress until it sealed, gave up, exited or produced every byte up to ``end`` (the save's
        virtual end), then free up to ``end``. ``starts``, ``ends``: where the save's items start
        and end (virtual, in order), which frees the padding before the item being produced too
        (:func:`free_up_to`).

        A producer still running after ``timeout_s`` could still write into that space: freed, it
        is a later save's, whose checkpoint would commit this save's bytes. A snapshot child is
        killed, and the space freed once it is gone. The rank's own process (a copier thread)
        cannot be: the ring is frozen instead (:meth:`RingMap.freeze`: it frees no more space,
        so the rank's later saves fail waiting for room, pointing at this daemon's log, which
        says why), and False returned."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                produced = self.progress(ring)
                # Every byte produced (a lazy copy waiting for the fence to seal): only its control
                # block is still to be written, never the space.
                finished = self.sealed(ring) or produced >= end
                ring.set_consumed(min(free_up_to(produced, starts, ends), end))
            except StagingError:
                finished = True  # abandoned: it writes no more
            if finished or self.exit_watch is ExitWatch.GONE or self._wait_exit(0.002):
                ring.set_consumed(end)
                return True
            if time.monotonic() > deadline:
                break
        if self.child and self._kill():
            log.warning(
                "rank %d: killed snapshot process %d, still copying %g s after its save failed, before "
                "giving its staging ring space to later saves",
                self.rank,
                self.pid,
                timeout_s,
            )
            ring.set_consumed(end)
            return True
        ring.freeze(
            f"rank {self.rank}'s snapshot producer (process {self.pid}) still copied into the staging ring "
            f"{timeout_s:g} s after its save failed (CKPTD_SNAPSHOT_TIMEOUT_S), so none of the ring's space is "
            "given to later saves (they would commit its bytes). Close and recreate the Checkpointer"
        )
        log.error("%s", ring.frozen)
        return False

    def _kill(self) -> bool:
        """SIGKILL the snapshot child; whether it is gone within :data:`KILLED_EXIT_S`."""
        try:
            if self.exit_watch is ExitWatch.PIDFD:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            elif self.exit_watch is ExitWatch.POLL:
                if not _alive(self.pid, self.start_ticks):
                    return True  # gone, its pid maybe another process's by now
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return True  # gone already
        except OSError as exc:
            log.warning("rank %d: cannot kill snapshot process %d: %s", self.rank, self.pid, exc)
            return False
        return self._wait_exit(KILLED_EXIT_S)

    def _until(self, ring: RingMap, ready: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``ready()`` until it holds; a producer that exits first must have sealed the save."""
        if ready():
            return
        t0 = time.monotonic()
        try:
            while not ready():
                if self._wait_exit(0.002):  # sleeps until the next poll, or wakes at the exit
                    if not (ready() and self.sealed(ring)):
                        raise self._died()
                    return
                if time.monotonic() > t0 + timeout_s:
                    raise StagingError(
                        f"rank {self.rank}: snapshot process {self.pid} did not finish copying within "
                        f"{timeout_s:g} s (CKPTD_SNAPSHOT_TIMEOUT_S); this save is abandoned"
                    )
        finally:
            self.waited_s += time.monotonic() - t0

    def _died(self) -> StagingError:
        return StagingError(
            f"rank {self.rank}: snapshot process {self.pid} exited before it had copied every "
            f"shard (killed, or out of memory? /dev/shm has {shm_free_nbytes()} bytes free); this save "
            "is not persisted. Later saves retry; CKPTD_SNAPSHOT=copy stages inside save() instead"
        )

    def _wait_exit(self, timeout_s: float) -> bool:
        """Whether the child has exited, waiting up to ``timeout_s`` for it."""
        if self.exit_watch is ExitWatch.PIDFD:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            return bool(poller.poll(timeout_s * 1000))
        if self.exit_watch is ExitWatch.GONE:
            return True
        deadline = time.monotonic() + timeout_s
        while _alive(self.pid, self.start_ticks):
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True


def _alive(pid: int, start_ticks: int | None) -> bool:
    """Running (not gone, not a zombie waiting for its parent, not replaced by a later process
    given the same pid)."""
    return same_process(pid, start_ticks)


def free_up_to(produced: int, starts: Sequence[int], ends: Sequence[int]) -> int:
    """How far a save's ring space may be freed once its producer published ``produced`` (the
    items' virtual ``starts`` and ``ends``, in order): up to the next item's start when only the
    padding that aligns it lies between (an item a few bytes short of the ring's capacity needs
    that room before any of it is produced), else up to ``produced``. A producer may publish a
    point inside an item (a device copy lands in pieces): the rest of it is not written yet."""
    i = bisect.bisect_left(starts, produced)
    if i < len(starts) and (i == 0 or produced >= ends[i - 1]) and starts[i] - produced < ALIGN:
        return starts[i]
    return produced
