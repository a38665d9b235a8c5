"""A rank's staging ring: a bounded shared-memory buffer its saves stream through.

A rank stages its saves in one shared-memory segment of ``HEADER_NBYTES + capacity`` bytes, the
capacity set by the staging budget (``ckptd.config``: 1.25 x the rank's first save by default,
and budgets smaller than one save work too). Saves are laid out one after the other in a
*virtual* byte stream that never ends; virtual offset ``v`` lives at data offset ``v % capacity``.
The producer (the rank's fork child, its lazy copier, or ``save()`` itself) writes each item once
the daemon has consumed what was there, and the daemon writes each item to disk once it is
produced, so a save larger than the ring streams through it:

- ``consumed`` (header offset 0, written by the daemon): every virtual byte below it has been
  written to disk; the producer may write ``[v, v + n)`` once ``consumed >= v + n - capacity``;
- per save, a *control block* (``BLOCKS`` of them in the header): ``progress`` (the virtual end of
  what is produced, written after each item) and a random ``seal`` written after the last item;
  ``ABANDONED``/``NO_ROOM`` in ``progress`` say the save will never be sealed
  (ckptd.staging.fork, ckptd.staging.lazy; the daemon side is ckptd.daemon.snapshot).

Every save starts at a multiple of ``ALIGN`` and its items sit at the offsets ``place()`` gives
relative to its start, so an unchanged state sends an unchanged item layout. An item may wrap
around the end of the ring: the producer writes it in two ``pwrite`` calls, and the daemon maps
the data region twice, back to back (:class:`RingMap`), so every item is one contiguous view
there. An item larger than the capacity is stored as several chunks (:func:`split_items`).

The producer side uses only ``os``, ``mmap`` and ``ctypes``: it also runs in a forked snapshot
child, which must not call into torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from ..errors import SharedMemoryFullError

log = logging.getLogger(__name__)

HEADER_NBYTES = 4096
CONSUMED_AT = 0
BLOCKS = 32  # saves of one rank in flight at most
BLOCK_NBYTES = 64
_BLOCKS_AT = 64
SEAL_NBYTES = 16
PROGRESS_NBYTES = 8
ALIGN = 64
PAGE = 4096
# Progress values meaning that the save will never be sealed: abandoned (a source changed before
# the fence, ckptd.staging.lazy), or out of room (/dev/shm full while copying).
ABANDONED = (1 << 64) - 1
NO_ROOM = (1 << 64) - 2
# Smallest data region, whatever the budget says.
MIN_CAPACITY = 1 << 20

_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.005
_CHUNK_NBYTES = 64 << 20


class Placement(NamedTuple):
    """Where an item's bytes lie, relative to its save's start in the ring. A tuple: a save makes
    and compares one per item, and tuples are built and compared in C (a frozen dataclass costs
    ~1 us per item more)."""

    offset: int
    nbytes: int


def give_up_mark(failure: BaseException | None) -> int:
    """The progress value a producer publishes when it will never seal its save: NO_ROOM when it
    failed because /dev/shm is full (the SharedMemoryFullError of a rank's write, or ENOSPC from a
    snapshot child's ``pwrite``), else ABANDONED (also with no ``failure``: abandoned by choice).
    The daemon fails the save with the reason each value names (ckptd.daemon.snapshot)."""
    full = isinstance(failure, SharedMemoryFullError) or (
        isinstance(failure, OSError) and failure.errno == errno.ENOSPC
    )
    return NO_ROOM if full else ABANDONED


def block_offset(block: int) -> int:
    """Header offset of control block ``block``: its seal, then its progress."""
    if not 0 <= block < BLOCKS:
        raise ValueError(f"control block {block} outside 0..{BLOCKS - 1}")
    return _BLOCKS_AT + block * BLOCK_NBYTES


def span(ends: Any) -> int:
    """Virtual bytes a save takes: the end of its last item, rounded up to ``ALIGN``."""
    end = max(ends, default=0)
    return -(-end // ALIGN) * ALIGN


def capacity_for(fraction: float, node_nbytes: int, save_nbytes: int, local_world_size: int) -> int:
    """Data bytes of a rank's ring: ``fraction`` x this rank's save, or ``node_nbytes`` shared by
    the node's ``local_world_size`` ranks (see ckptd.config.parse_budget). Whole pages."""
    want = fraction * save_nbytes if fraction else node_nbytes / max(1, local_world_size)
    return max(MIN_CAPACITY, -(-math.ceil(want) // PAGE) * PAGE)


class RingFull(Exception):
    """The daemon did not consume enough of the ring in time (or is gone)."""


class _Header:
    """The ring's header page mapped shared, as 8-byte words (see :class:`RingWriter`)."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, HEADER_NBYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # Writers read this attribute at each access, never keep it: close() can then unmap.
        self.words: Any = (ctypes.c_uint64 * (HEADER_NBYTES // 8)).from_buffer(self._map)

    def close(self) -> None:
        """Unmap (idempotent). A writer used after it raises (TypeError), never touches freed
        memory: a word being read or written meanwhile keeps the map exported, and so mapped."""
        words, self.words = self.words, None
        del words  # the export of the map's buffer goes with the last reference
        with contextlib.suppress(BufferError):
            self._map.close()


class RingWriter:
    """The producer's access to a ring through its segment's descriptor: data by ``pwrite``, the
    header's 8-byte counters through a mapping of the header page, as single aligned 8-byte loads
    and stores. A ``pread``/``pwrite`` of them is the kernel's copy, which may move one byte at a
    time (``rep movsb``): a ``consumed`` read while the daemon updates it could mix new and old
    bytes and let the producer overwrite bytes not persisted yet, and a torn ``progress`` let the
    daemon write items not produced yet."""

    def __init__(
        self,
        fd: int,
        capacity: int,
        timeout_s: float,
        alive: Callable[[], bool] | None = None,
        *,
        header: _Header | None = None,
    ) -> None:
        self.fd = fd
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.alive = alive  # whether the consumer can still make room (checked while waiting)
        self._header = header if header is not None else _Header(fd)

    def watching(self, alive: Callable[[], bool]) -> RingWriter:
        """This writer, giving up a wait for room once ``alive()`` is false (same mapping)."""
        return RingWriter(self.fd, self.capacity, self.timeout_s, alive, header=self._header)

    def close(self) -> None:
        """Unmap the header (the ring's owner closes it; a forked child's copy goes with the child)."""
        self._header.close()

    def consumed(self) -> int:
        return int(self._header.words[CONSUMED_AT // 8])

    def has_room(self, v_end: int) -> bool:
        return self.consumed() >= v_end - self.capacity

    def wait_room(self, v_end: int) -> float:
        """Return once ``[.., v_end)`` may be written; the seconds waited. Raises RingFull."""
        if self.has_room(v_end):
            return 0.0
        t0 = time.monotonic()
        pause = _POLL_MIN_S
        while not self.has_room(v_end):
            waited = time.monotonic() - t0
            if waited > self.timeout_s or (self.alive is not None and not self.alive()):
                raise RingFull(
                    f"the node daemon consumed the staging ring only up to {self.consumed()} "
                    f"of the {v_end - self.capacity} bytes needed within {waited:.1f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        return time.monotonic() - t0

    def write(self, v: int, view: memoryview) -> None:
        """``pwrite`` ``view`` at virtual offset ``v`` (in two parts where it wraps)."""
        while view.nbytes:
            at = v % self.capacity
            n = min(view.nbytes, self.capacity - at, _CHUNK_NBYTES)
            done = os.pwrite(self.fd, view[:n], HEADER_NBYTES + at)
            view, v = view[done:], v + done

    def publish(self, block: int, value: int) -> None:
        self._header.words[(block_offset(block) + SEAL_NBYTES) // 8] = value

    def seal(self, block: int, seal: bytes) -> None:
        os.pwrite(self.fd, seal, block_offset(block))

    def copy(self, start: int, copies: list[tuple[int, int, int]], block: int) -> float:
        """Copy ``(relative offset, source address, nbytes)`` items in order, waiting for room and
        publishing the progress after each; returns the seconds spent waiting for room."""
        waited = 0.0
        for rel, address, n in copies:
            v = start + rel
            waited += self.wait_room(v + n)
            if n:
                self.write(v, memoryview((ctypes.c_char * n).from_address(address)).cast("B"))
            self.publish(block, v + n)
        return waited


class RingMap:
    """The daemon's mapping of a ring: the header, and the data region mapped twice back to back,
    so that ``[a, a + n)`` is contiguous for every ``a < capacity`` and ``n <= capacity``."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        self.header = mmap.mmap(fd, HEADER_NBYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = _double_map(fd, capacity)
        self.data = (ctypes.c_char * (2 * capacity)).from_address(self.address)
        self.frozen = ""  # why the ring frees no more space (:meth:`freeze`); "" while it does

    def view(self, v: int, nbytes: int) -> memoryview:
        """The bytes of virtual ``[v, v + nbytes)``, without a copy."""
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit a ring of {self.capacity}")
        at = v % self.capacity
        return memoryview(self.data).cast("B")[at : at + nbytes]

    def consumed(self) -> int:
        return int.from_bytes(self.header[CONSUMED_AT : CONSUMED_AT + 8], "little")

    def set_consumed(self, v: int) -> None:
        if v > self.consumed() and not self.frozen:
            self.header[CONSUMED_AT : CONSUMED_AT + 8] = v.to_bytes(8, "little")

    def freeze(self, why: str) -> None:
        """Free no more space from now on (``why``: a producer may still write into the space
        not freed yet; ckptd.daemon.snapshot.SnapshotWait.drain)."""
        self.frozen = why

    def progress(self, block: int) -> int:
        at = block_offset(block) + SEAL_NBYTES
        return int.from_bytes(self.header[at : at + PROGRESS_NBYTES], "little")

    def sealed_with(self, block: int) -> bytes:
        at = block_offset(block)
        return bytes(self.header[at : at + SEAL_NBYTES])

    def close(self) -> None:
        """Unmap the data region once no view of it is held any more: at once, or, when a view
        handed out is still held, when the last one is released.

        Every view refers to :attr:`data` (through the buffer it was exported from), so the region
        is unmapped by a finalizer of that object. An object-store client may hold a part it was
        lent past its request's timeout, after the write that lent it failed and its ring was
        released: unmapping under it would crash the daemon, so the mapping outlives the ring
        until the client lets go (until the daemon exits at the latest).
        """
        data, self.data = self.data, None  # type: ignore[assignment]
        if data is not None:
            unmapped = weakref.finalize(data, _unmap, self.address, 2 * self.capacity)
            self.address = 0
            del data  # the last reference, unless a view is held
            if unmapped.alive:
                log.warning(
                    "a staging ring of %d bytes stays mapped until its last view is released (an upload "
                    "still holds a part of it)",
                    self.capacity,
                )
        self.header.close()


def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _unmap(address: int, nbytes: int) -> None:
    _libc().munmap(ctypes.c_void_p(address), ctypes.c_size_t(nbytes))


def _double_map(fd: int, capacity: int) -> int:
    """Map ``[HEADER_NBYTES, HEADER_NBYTES + capacity)`` of ``fd`` twice, adjacently; the address."""
    libc = _libc()
    failed = ctypes.c_void_p(-1).value
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    base = libc.mmap(None, 2 * capacity, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
    if base in (None, failed):
        raise OSError(ctypes.get_errno(), f"cannot reserve {2 * capacity} bytes of address space")
    fixed = getattr(mmap, "MAP_FIXED", 0x10)
    for half in (0, capacity):
        got = libc.mmap(ctypes.c_void_p(base + half), capacity, prot, mmap.MAP_SHARED | fixed, fd, HEADER_NBYTES)
        if got != base + half:
            err = ctypes.get_errno()
            libc.munmap(ctypes.c_void_p(base), ctypes.c_size_t(2 * capacity))
            raise OSError(err, f"cannot map the staging ring twice ({os.strerror(err)})")
    return base
