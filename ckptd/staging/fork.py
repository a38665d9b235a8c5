"""Copy-on-write snapshots: a forked child copies the shards into the ring while training goes on.

``fork()`` gives the child a private, copy-on-write view of the trainer's memory as it is at that
instant. The child copies the shards from that view into the rank's staging ring and exits; the
trainer returns from ``save()`` right after the fork and may overwrite its tensors at once: the
kernel copies a page the first time the trainer writes it while the child lives, so the child
still reads the values of the save. The training stall is the ``fork()`` itself (copying page
tables: ~20 ms per GiB of trainer memory on 4 KiB pages, measured on the CI machine) instead of a
copy of every byte; what moves out of the stall is the first write to each page during the
child's copy (a page fault plus a 4 KiB copy).

The child copies in order, each item once the daemon has consumed the ring space it needs
(:mod:`ckptd.staging.ring`: a save bigger than the ring streams through it), publishes its
progress after each item, then proves it finished by writing a random *seal* in the save's
control block. It runs in a new session, so a signal to the trainer's process group (torchrun
stopping workers) does not kill it half-way, and a trainer killed right after ``save()``
returned still gets its checkpoint. The node daemon writes each item once the child's progress
covers it and publishes the file only once the seal is there (ckptd.daemon.snapshot): a child
that died early fails the save, half a copy is never persisted.

Only plain CPU tensors in private memory and bytes are copied by the child; anything else (CUDA
tensors, strided views, and tensors in shared or pinned memory, whose pages a fork shares rather
than copies on write: the child would see the trainer's writes; memory torch did not allocate is
looked up in ``/proc/self/maps``) makes :func:`child_copies` return None and the save is produced
by the trainer. The child
runs nothing but ``pwrite``/``pread`` and ``_exit``: no torch, no locks, no sockets; it closes
every descriptor it inherited but the ring's.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import os
import select
import signal
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..format.items import PlannedItem
from .producer import Claim, Snapshot, process_alive, start_block
from .rankside import Placement, StagingRing, plain_cpu_bytes
from .ring import RingFull, RingWriter, block_offset, give_up_mark, span

log = logging.getLogger(__name__)

# A forked child reports within START_TIMEOUT_S that it started (normally well under a
# millisecond) or is killed and forked again, FORK_TRIES times at most (see fork_started).
START_TIMEOUT_S = 1.0
FORK_TRIES = 3


def fork_available() -> bool:
    return hasattr(os, "fork") and hasattr(os, "setsid")


def child_copies(
    items: list[PlannedItem], placements: list[Placement]
) -> tuple[list[tuple[int, int, int]], list[Any]] | None:
    """``((relative offset, source address, nbytes), ...)`` for the child, and the objects that
    must stay alive until it was forked; None when some payload is not plain CPU memory or bytes.
    The child sees the trainer's memory as it was at the fork, so addresses are all it needs."""
    copies: list[tuple[int, int, int]] = []
    keep: list[Any] = []
    cuda_initialized = torch.cuda.is_initialized()
    shared: SharedMappings | None = None
    for item, p in zip(items, placements):
        src = item.payload
        if isinstance(src, torch.Tensor):
            # share_memory_(), torch.from_file(shared=True) and pinned memory are mapped shared:
            # a fork does not copy them on write, so the child would copy the trainer's later writes.
            # Pinned memory exists only once CUDA is initialized; asking before could create a
            # CUDA context in a CPU-only trainer.
            if not plain_cpu_bytes(src) or src.is_shared() or (cuda_initialized and src.is_pinned()):
                return None
            if not src.untyped_storage().resizable():
                # Memory torch did not allocate (from_numpy of a np.memmap or of shared_memory,
                # frombuffer of an mmap) may be mapped shared, which is_shared() does not know.
                shared = shared if shared is not None else SharedMappings.of_this_process()
                if shared is None or shared.holds(src.data_ptr(), p.nbytes):
                    return None
            copies.append((p.offset, src.data_ptr(), p.nbytes))
        else:
            buf = ctypes.create_string_buffer(bytes(src), p.nbytes)
            keep.append(buf)
            copies.append((p.offset, ctypes.addressof(buf), p.nbytes))
    return copies, keep


class SharedMappings:
    """The address ranges this process maps shared (``/proc/self/maps``: an ``s`` in the
    permissions), which a fork shares with the child instead of copying on write."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [lo for lo, _ in self.ranges]

    @classmethod
    def of_this_process(cls) -> SharedMappings | None:
        """None when the maps cannot be read (no /proc): then nothing counts as private."""
        try:
            with open("/proc/self/maps", "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        ranges = []
        for line in lines:
            fields = line.split(maxsplit=2)
            if len(fields) >= 2 and fields[1][3:4] == b"s":
                lo, _, hi = fields[0].partition(b"-")
                ranges.append((int(lo, 16), int(hi, 16)))
        return cls(ranges)

    def holds(self, address: int, nbytes: int) -> bool:
        """Whether any of ``[address, address + nbytes)`` is mapped shared."""
        # The last range starting at or before the span's last byte is the only one that can
        # reach into it (the process's mappings do not overlap).
        i = bisect.bisect_right(self.starts, address + max(nbytes, 1) - 1)
        return i > 0 and self.ranges[i - 1][1] > address


def fork_snapshot(
    ring: StagingRing, start: int, block: int, copies: list[tuple[int, int, int]], nice: int, daemon_pid: int
) -> Snapshot | None:
    """Fork a child that produces ``copies`` at virtual ``start`` and then seals ``block``;
    returns once it started (None if no child started: :func:`fork_started`). The child runs at
    CPU niceness ``nice`` (added to the trainer's), and gives up when the daemon (``daemon_pid``)
    is gone or makes no room for ``snapshot_timeout_s``."""
    seal = start_block(ring, block)
    end = start + span(rel + n for rel, _, n in copies)
    writer = ring.writer.watching(process_alive(daemon_pid))
    pid = fork_started(lambda: _child(writer, start, end, block, copies, seal, nice))
    return None if pid is None else Snapshot(pid=pid, seal=seal, seal_offset=block_offset(block))


def fork_started(
    run: Callable[[], None], start_timeout_s: float = START_TIMEOUT_S, tries: int = FORK_TRIES
) -> int | None:
    """fork(); the child tells the parent through a pipe that it started, then calls ``run`` and
    exits. Returns the pid of a child that started, or None when ``tries`` children in a row did
    not within ``start_timeout_s`` each (each is killed and reaped).

    Why the handshake: before it runs a line of our code, the child runs the interpreter's own
    after-fork code, and CPython before 3.12 deadlocks there for good when another thread held
    the runtime's thread-state lock at the fork (CPython gh-112275: any thread creating or
    deleting a Python thread state without the GIL, e.g. a C++ thread of a library calling back
    into Python). A child stuck there never copies its save, which then failed only after
    ``snapshot_timeout_s``; measured here, 2 in 1,000 forks with six threads creating thread
    states, and once in a ``ckptd bench all`` run. The trainer has not returned from ``save()``
    yet, so its memory is unchanged and a second fork snapshots the same state."""
    for attempt in range(1, tries + 1):
        r, w = os.pipe()
        try:
            with warnings.catch_warnings():
                # Python >= 3.12 warns about fork() in a threaded process; the child runs no threaded code.
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:
            try:
                os.close(r)
                os.write(w, b"\1")
                os.close(w)
                run()
            finally:
                os._exit(1)  # run() exits by itself; this only catches an escape
        os.close(w)
        started = False
        try:
            # poll(), not select(): a trainer may hold more than 1,024 descriptors. It retries
            # after a signal with the time left (PEP 475).
            poller = select.poll()
            poller.register(r, select.POLLIN)
            started = bool(poller.poll(start_timeout_s * 1000)) and os.read(r, 1) == b"\1"
        finally:
            os.close(r)
            if not started:
                # Also on an exception here (a KeyboardInterrupt): nobody would track the child,
                # and the save's ring range it copies into would be handed back.
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if started:
            return pid
        log.warning(
            "snapshot process %d did not start within %.1f s (try %d of %d; stuck in the interpreter's "
            "after-fork code, CPython gh-112275 before Python 3.12): killed it%s",
            pid,
            start_timeout_s,
            attempt,
            tries,
            ", forking again" if attempt < tries else "",
        )
    return None


def _child(
    writer: RingWriter, start: int, end: int, block: int, copies: list[tuple[int, int, int]], seal: bytes, nice: int
) -> None:
    """Copy with ``pwrite`` into the ring in order, publishing the progress after each copy (the
    daemon writes an item to disk as soon as it is complete), then the seal. Not through the
    mapping: fork() does not copy the page tables of shared mappings, so writing the ring through
    memory would fault on every 4 KiB page (0.9 s for 2 GiB here, 0.45 s by pwrite), and a full
    /dev/shm would be a SIGBUS instead of an error the daemon can report."""
    code = 1
    try:
        os.setsid()
        _keep_only(writer.fd)
        if nice > 0:
            os.nice(nice)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            try:
                signal.signal(sig, signal.SIG_DFL)  # never the trainer's handlers
            except (ValueError, OSError):
                pass
        try:
            writer.copy(start, copies, block)
        except (OSError, RingFull) as exc:  # say why in the (allocated) control block, then die
            writer.publish(block, give_up_mark(exc))
            raise
        writer.publish(block, end)
        writer.seal(block, seal)
        code = 0
    finally:
        os._exit(code)


def _keep_only(fd: int) -> None:
    """Close every descriptor the child inherited but ``fd`` (the ring's); stdin, stdout and stderr
    become /dev/null (are closed where it cannot be opened). A trainer that exits while its child
    still copies (or waits for ring room) must not keep its launcher's pipes
    (``subprocess.run(capture_output=True)``, a job's log collector) and its sockets open through
    the child until it gives up. The open descriptors are listed (``/proc/self/fd``), not every
    number up to the limit closed: without close_range(2) that takes seconds where the limit is
    high, and a descriptor above a lowered limit would be missed."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        null = -1
    for std in (0, 1, 2):
        if std not in (null, fd):
            with contextlib.suppress(OSError):
                if null >= 0:
                    os.dup2(null, std)
                else:
                    os.close(std)
    keep = {0, 1, 2, fd}
    inherited: Iterable[int]
    try:
        inherited = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: every number up to the limit
        inherited = range(max(os.sysconf("SC_OPEN_MAX"), fd + 1, 1024))
    for n in inherited:
        if n not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone already
                os.close(n)


def reap(pids: list[int], block: bool) -> list[int]:
    """Collect exited snapshot children; returns the pids still running."""
    left = []
    for pid in pids:
        try:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            continue
        if done == 0:
            left.append(pid)
        elif os.waitstatus_to_exitcode(status) != 0:
            log.warning(
                "snapshot process %d exited with status %d; its save fails on its handle",
                pid,
                os.waitstatus_to_exitcode(status),
            )
    return left


def fork_into(ring: StagingRing, claim: Claim, nice: int, daemon_pid: int) -> Snapshot | None:
    """A fork snapshot of the claimed save, or None when it cannot fork (payloads the child cannot
    copy, no fork on this system, or fork() failing): the caller then produces the items itself."""
    if not fork_available():
        return None
    found = child_copies(claim.items, claim.placements)
    if found is None:
        return None
    copies, keep = found
    try:
        snap = fork_snapshot(ring, claim.start, claim.block, copies, nice, daemon_pid)
    except OSError as exc:  # EAGAIN/ENOMEM: too many processes, or no memory for page tables
        log.warning(
            "rank %d: fork() for a copy-on-write snapshot failed (%s); copying inside save() instead", ring.rank, exc
        )
        return None
    finally:
        del keep  # the child has its own copy of the buffers now
    if snap is None:
        log.warning("rank %d: no snapshot process started; copying inside save() instead", ring.rank)
    return snap
