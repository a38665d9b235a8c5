"""Which process a pid names now: its parent, state and start time, read from ``/proc/<pid>/stat``.

A pid is reused once its process is gone, so a process is identified by its pid *and* its start
time. The start time is taken in clock ticks since boot (``/proc/<pid>/stat`` field 22), never
as wall-clock seconds: psutil's ``create_time()`` adds the boot time of ``/proc/stat`` (``btime``),
which moves whenever the wall clock is stepped (NTP, a VM resumed or migrated, ``date -s``), so a
process compared by it seems to have been replaced after a one-second step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_GONE = frozenset("ZXx")  # zombie, dead: exited, whether or not reaped yet


@dataclass(frozen=True, kw_only=True)
class ProcStat:
    pid: int
    ppid: int
    state: str  # one letter: R, S, D, T, Z, X...
    start_ticks: int  # since boot, in clock ticks (CLOCK_TICK_S each)

    @property
    def exited(self) -> bool:
        return self.state in _GONE

    @property
    def started_s(self) -> float:
        """The start on the CLOCK_BOOTTIME clock, truncated to a clock tick."""
        return self.start_ticks * CLOCK_TICK_S


def read_stat(pid: int) -> ProcStat | None:
    """``pid``'s entry, or None when no process has that pid. Raises OSError for other failures
    (no permission to read /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last.
    fields = raw.rsplit(b")", 1)[1].split()
    return ProcStat(pid=pid, state=fields[0].decode(), ppid=int(fields[1]), start_ticks=int(fields[19]))


def same_process(pid: int, start_ticks: int | None) -> bool:
    """The process that had ``start_ticks`` when it was seen as ``pid`` still runs (not a zombie,
    and not replaced by a later process with the same pid)."""
    try:
        st = read_stat(pid)
    except OSError:
        return True  # cannot tell: a process must never be declared dead on a failed read
    if st is None or st.exited:
        return False
    return start_ticks is None or st.start_ticks == start_ticks


def start_ticks_of(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot, or None (gone, or unreadable)."""
    try:
        st = read_stat(pid)
    except OSError:
        return None
    return None if st is None else st.start_ticks
