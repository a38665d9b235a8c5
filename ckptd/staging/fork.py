"""Copy-on-write snapshots: a forked child copies the shards into the slot while training goes on.

``fork()`` gives the child a private, copy-on-write view of the trainer's memory as it is at that
instant. The child copies the shards from that view into the staging slot (a ``MAP_SHARED``
mapping both see) and exits; the trainer returns from ``save()`` right after the fork and may
overwrite its tensors at once: the kernel copies a page the first time the trainer writes it
while the child lives, so the child still reads the values of the save. The training stall is
the ``fork()`` itself (copying page tables: ~20 ms per GiB of trainer memory on 4 KiB pages,
measured on the CI machine) instead of a copy of every byte; what moves out of the stall is the
first write to each page during the child's copy (a page fault plus a 4 KiB copy).

The child copies in slot order and publishes its progress after each item, then proves it
finished by writing a random *seal*. It runs in a new session, so a signal to the trainer's
process group (torchrun stopping workers) does not kill it half-way, and a trainer killed right
after ``save()`` returned still gets its checkpoint. The node daemon writes each item once the
child's progress covers it and publishes the file only once the seal is there
(ckptd.daemon.snapshot): a child that died early fails the save, half a copy is never persisted.

Only plain CPU tensors and bytes are copied by the child; anything else (CUDA tensors, strided
views) makes :func:`child_copies` return None and the save stages in the trainer, as without fork.
The child runs nothing but ``pwrite`` and ``_exit``: no torch, no locks, no sockets.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import signal
import warnings
from dataclasses import dataclass

import torch

from ..errors import StagingError
from ..format.items import PlannedItem
from .pool import Placement, StagingPool, plain_cpu_bytes
from .segment import ShmSegment

log = logging.getLogger(__name__)

SEAL_NBYTES = 16
# After the seal: the child's progress, a little-endian uint64: every slot byte below it is copied.
PROGRESS_NBYTES = 8
# Progress values meaning that the snapshot will never be sealed: abandoned (a source changed
# before the fence, ckptd.staging.lazy), or out of room (/dev/shm full while copying).
ABANDONED = (1 << 64) - 1
NO_ROOM = (1 << 64) - 2
# Room reserved after a save's bytes in its slot for seal and progress (64-byte aligned).
SEAL_ROOM_NBYTES = 64


def seal_offset(nbytes: int) -> int:
    """Where the seal of a save of ``nbytes`` slot bytes goes."""
    return -(-nbytes // SEAL_ROOM_NBYTES) * SEAL_ROOM_NBYTES


def fork_available() -> bool:
    return hasattr(os, "fork") and hasattr(os, "setsid")


def child_copies(items: list[PlannedItem], placements: list[Placement],
                 segment: ShmSegment) -> list[tuple[int, int, int]] | None:
    """``(slot_offset, src_address, nbytes)`` for the child, or None when some payload is not
    plain CPU memory. ``bytes`` payloads (small pickled objects) are copied here, before the fork.
    """
    copies: list[tuple[int, int, int]] = []
    small: list[tuple[int, bytes]] = []
    for item, p in zip(items, placements):
        src = item.payload
        if isinstance(src, torch.Tensor):
            if not plain_cpu_bytes(src):
                return None
            if p.nbytes:
                copies.append((p.offset, src.data_ptr(), p.nbytes))
        else:
            small.append((p.offset, bytes(src)))
    for offset, data in small:
        segment.write(offset, data)
    return copies


@dataclass(frozen=True)
class Snapshot:
    """A running snapshot child: its pid and the seal it writes at ``seal_offset`` when done."""

    pid: int
    seal: bytes
    seal_offset: int


def fork_snapshot(copies: list[tuple[int, int, int]], segment: ShmSegment, nbytes: int,
                  nice: int = 0) -> Snapshot:
    """Fork a child that performs ``copies`` into ``segment`` and then seals it; returns at once.
    The child runs at CPU niceness ``nice`` (added to the trainer's), yielding to training."""
    if segment.base is None:
        raise StagingError(f"segment {segment.name} is not mapped")
    at = seal_offset(nbytes)
    seal = secrets.token_bytes(SEAL_NBYTES)
    # No stale seal or progress of an earlier save in this slot.
    segment.write(at, bytes(SEAL_NBYTES + PROGRESS_NBYTES))
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() in a threaded process; the child runs no threaded code.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        _child(copies, segment.fileno(), at, seal, nbytes, nice)
    return Snapshot(pid, seal, at)


def _child(copies: list[tuple[int, int, int]], fd: int, at: int, seal: bytes, nbytes: int, nice: int) -> None:
    """Copy with ``pwrite`` into the segment's file in slot order, publishing the progress after
    each copy (the daemon writes an item to disk as soon as it is complete), then the seal. Not
    through the mapping: fork() does not copy the page tables of shared mappings, so writing the
    slot through memory would fault on every 4 KiB page (0.9 s for 2 GiB here, 0.45 s by pwrite)."""
    code = 1
    try:
        os.setsid()
        if nice > 0:
            os.nice(nice)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            try:
                signal.signal(sig, signal.SIG_DFL)  # never the trainer's handlers
            except (ValueError, OSError):
                pass
        progress_at = at + SEAL_NBYTES
        for offset, src, n in sorted(copies):
            view = memoryview((ctypes.c_char * n).from_address(src)).cast("B")
            while view.nbytes:
                try:
                    done = os.pwrite(fd, view[:_CHUNK_NBYTES], offset)
                except OSError:  # ENOSPC: say so in the (allocated) progress field, then die
                    os.pwrite(fd, NO_ROOM.to_bytes(PROGRESS_NBYTES, "little"), progress_at)
                    raise
                view, offset = view[done:], offset + done
            os.pwrite(fd, offset.to_bytes(PROGRESS_NBYTES, "little"), progress_at)
        os.pwrite(fd, nbytes.to_bytes(PROGRESS_NBYTES, "little"), progress_at)
        os.pwrite(fd, seal, at)
        code = 0
    finally:
        os._exit(code)


_CHUNK_NBYTES = 64 << 20


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
            log.warning("snapshot process %d exited with status %d; its save fails on its handle",
                        pid, os.waitstatus_to_exitcode(status))
    return left


def snapshot_into(pool: StagingPool, slot: int, items: list[PlannedItem], placements: list[Placement],
                  nbytes: int, allow_fork: bool, nice: int = 0) -> Snapshot | None:
    """Get a save's shards into ``slot``: by a forked child (returned) or copied here (None).

    The slot must hold ``nbytes + SEAL_ROOM_NBYTES``.
    """
    seg = pool.segments[slot]
    if allow_fork and seg.base is not None and fork_available():
        seg.check_room(seal_offset(nbytes) + SEAL_ROOM_NBYTES)  # a full /dev/shm fails here, cleanly
        copies = child_copies(items, placements, seg)
        if copies is not None:
            try:
                return fork_snapshot(copies, seg, nbytes, nice)
            except OSError as exc:  # EAGAIN/ENOMEM: too many processes, or no memory for page tables
                log.warning("rank %d: fork() for a copy-on-write snapshot failed (%s); copying inside "
                            "save() instead", pool.rank, exc)
    pool.stage(slot, items, placements)
    return None
