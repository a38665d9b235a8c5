"""Peak memory of a benchmark's processes, sampled from outside while it runs.

A :class:`MemorySampler` thread in the launching process asks psutil for the memory of every
process of the benchmark every ``interval_s`` and keeps, per *phase* (a name the benchmark's rank 0
writes into a file) and per *role*, the peak of:

- ``rss``: resident set size;
- ``shm``: the part of it that is shared memory (``RssShmem``: staging rings, DCP's shared stager);
- ``private``: ``rss - shm`` (heap, tensors, Python objects, libraries and modules);

plus the node's ``/dev/shm`` use above what it was when sampling started (``node_shm``:
``statvfs``, so the segments of every process count, whoever maps them, other tenants' too), and
the pages of ``/dev/shm`` this benchmark's ckptd segments hold (``ckptd_shm``: the staging rings,
whatever else happens on the node).

Roles: ``trainer`` (the rank processes, the maximum over ranks), ``dcp_bg`` (their children: torch
DCP's checkpoint process), ``daemon`` (ckptd node daemons: found by their pid files, or as a
rank's child running ``ckptd.cli daemon`` while it starts).

It also adds up the CPU time (user + system) each role used during each phase (``cpu_s``, summed
over the role's processes), and the node's busy CPU time (``node_cpu_s``, every process and the
kernel's threads, other users' too): what the work of a checkpointer costs the node's cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from ckptd.control.pidfile import daemon_pid
from ckptd.staging.segment import SHM_DIR, allocated_nbytes, list_segments


def proc_memory(pid: int) -> dict[str, int] | None:
    """``rss``, ``shm`` and ``private`` bytes of ``pid`` (None when it is gone), from one read of
    ``/proc/<pid>/status``: RSS and RssShmem read apart (psutil's RSS, then the file) disagree by
    whatever the process mapped or unmapped in between (the daemon's peak in the lazy-snapshot
    phase read 274 MiB "private" that way, 215 MiB read at once). RssShmem is read by hand because
    psutil has no such figure (its ``shared`` also counts file-backed pages, ~77 MiB of torch's
    libraries here, which would make the memory "beyond the rings" look smaller than it is)."""
    fields: dict[bytes, int] = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, value = line.partition(b":")
                if key in (b"VmRSS", b"RssShmem"):
                    fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if b"VmRSS" not in fields:  # a zombie: no memory left to count
        return None
    rss, shm = fields[b"VmRSS"], fields.get(b"RssShmem", 0)
    return {"rss": rss, "shm": shm, "private": rss - shm}


def shm_used_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def segments_nbytes(prefix: str) -> int:
    """Pages of ``/dev/shm`` the segments named ``prefix*`` hold (allocated, not their size)."""
    total = 0
    for name in list_segments(prefix):
        try:
            total += allocated_nbytes(SHM_DIR / name)
        except OSError:  # unlinked meanwhile
            pass
    return total


def daemon_pids(runtime_dir: Path) -> list[int]:
    """Pids written in the ``*.pid`` files of a (private) runtime directory (ckptd.control.pidfile)."""
    try:
        names = os.listdir(runtime_dir)
    except FileNotFoundError:
        return []
    pids = (daemon_pid(runtime_dir / name) for name in names if name.endswith(".pid"))
    return [pid for pid in pids if pid is not None]


class MemorySampler:
    """Samples the benchmark's processes in a thread; :meth:`peaks` returns what it saw."""

    def __init__(self, runtime_dir: Path, phase_file: Path, shm_prefix: str = "", interval_s: float = 0.05) -> None:
        self.runtime_dir = runtime_dir
        self.shm_prefix = shm_prefix
        self.phase_file = phase_file
        self.interval_s = interval_s
        self._trainers: Callable[[], Iterable[int]] = lambda: ()
        self._peaks: dict[str, dict[str, int]] = {}
        self._cpu: dict[str, dict[str, float]] = {}  # phase -> role -> CPU seconds
        self._cpu_seen: dict[int, float] = {}  # pid -> its CPU seconds at the previous sample
        self._node_busy: float | None = None
        self._daemon_cmd: dict[int, bool] = {}
        self._descendants: dict[int, psutil.Process] = {}  # every non-daemon child of a rank seen
        self._shm0 = shm_used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-memory", daemon=True)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def watch(self, trainers: Callable[[], Iterable[int]]) -> None:
        """Sample these rank processes (and their children) from now on."""
        self._trainers = trainers

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def kill_leftovers(self) -> list[int]:
        """Kill the ranks' children seen while sampling that still run (DCP's checkpoint
        processes, snapshot children); their pids. A job that failed leaves them orphaned: its
        ranks were killed before they could stop them. (Daemons have pid files and are stopped
        apart.) psutil checks each process's start time, so a reused pid is never killed."""
        killed = []
        for proc in list(self._descendants.values()):  # the sampling thread may still add
            try:
                if proc.is_running():
                    proc.kill()
                    killed.append(proc)
            except psutil.Error:
                pass
        psutil.wait_procs(killed, timeout=10)
        return [proc.pid for proc in killed]

    def peaks(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {phase: dict(v) for phase, v in self._peaks.items()}
        for phase, roles in self._cpu.items():
            out.setdefault(phase, {}).update({f"{role}_cpu_s": round(v, 3) for role, v in roles.items()})
        return out

    def _phase(self) -> str:
        try:
            return self.phase_file.read_text().strip() or "setup"
        except OSError:
            return "setup"

    def _bump(self, phase: str, key: str, value: int) -> None:
        for name in (phase, "all"):
            d = self._peaks.setdefault(name, {})
            if value > d.get(key, 0):
                d[key] = value

    def sample(self) -> None:
        phase = self._phase()
        trainers = list(self._trainers())
        roles: list[tuple[str, int]] = [("trainer", p) for p in trainers]
        daemons = set(daemon_pids(self.runtime_dir))
        for pid in trainers:
            try:
                children = psutil.Process(pid).children(recursive=True)
            except psutil.Error:
                continue
            for c in children:
                if self._is_ckptd_daemon(c):
                    daemons.add(c.pid)  # a daemon a rank is starting, before its pid file exists
                else:
                    roles.append(("dcp_bg", c.pid))
                    self._descendants.setdefault(c.pid, c)
        roles = [(r, p) for r, p in roles if p not in daemons] + [("daemon", p) for p in daemons]
        for role, pid in roles:
            mem = proc_memory(pid)
            if mem is None:
                continue
            for key, value in mem.items():
                self._bump(phase, f"{role}_{key}", value)
            self._add_cpu(phase, role, pid)
        self._bump(phase, "node_shm", max(0, shm_used_bytes() - self._shm0))
        if self.shm_prefix:
            self._bump(phase, "ckptd_shm", segments_nbytes(self.shm_prefix))
        self._add_node_cpu(phase)

    def _is_ckptd_daemon(self, proc: psutil.Process) -> bool:
        found = self._daemon_cmd.get(proc.pid)
        if found is None:
            try:
                cmd = proc.cmdline()
            except psutil.Error:
                return False
            found = self._daemon_cmd[proc.pid] = "ckptd.cli" in cmd and "daemon" in cmd
        return found

    def _add_node_cpu(self, phase: str) -> None:
        """Busy CPU time of the whole node (all CPUs, not idle nor waiting for I/O) since the
        previous sample: it includes the kernel's own threads (page-cache writeback, reclaim),
        which no process is charged."""
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        if self._node_busy is not None:
            for name in (phase, "all"):
                roles = self._cpu.setdefault(name, {})
                roles["node"] = roles.get("node", 0.0) + busy - self._node_busy
        self._node_busy = busy

    def _add_cpu(self, phase: str, role: str, pid: int) -> None:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return
        now = t.user + t.system
        # A process first seen now started since the previous sample: count all of its time.
        used = now - self._cpu_seen.get(pid, 0.0)
        self._cpu_seen[pid] = now
        for name in (phase, "all"):
            roles = self._cpu.setdefault(name, {})
            roles[role] = roles.get(role, 0.0) + used

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
