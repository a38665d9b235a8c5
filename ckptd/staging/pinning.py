"""Pinning a staging ring for device-to-host DMA: in the background, chunk by chunk, never in ``save()``.

A device-to-host copy is DMA only into *registered* (pinned) host memory; into pageable memory
the driver stages it through buffers of its own, synchronously and many times slower. Pinning is
what costs, not the copy (measured on an H100 machine, 4 GiB of ``/dev/shm``: allocating the pages
0.51 s, ``cudaHostRegister`` 0.95-1.56 s, the device-to-host copy into it 0.078 s). So a rank's
ring is pinned by a :class:`RingPinner` thread as soon as the ring exists (the Checkpointer
creates it when it first learns the size of a save: ``prepare()``, ``load()``, a byte budget, or
the first ``save()``), in chunks of :data:`CHUNK_NBYTES`, each allocated (``posix_fallocate``:
a full ``/dev/shm`` is an error, never a SIGBUS) and then registered. A save's CUDA tensors are
copied by DMA only into chunks registered already, one copy never spanning two chunks (each chunk
is its own registration, and a copy is recognised as pinned only within one): see
:mod:`ckptd.staging.devcopy`. A save that finds its chunk not registered yet waits for the pinner
(the first save of a job that gave no size before it); a ring that cannot be pinned (pinning off,
or the registration failed) is filled through an explicit pageable copy, never by a DMA that
silently became one.

The CUDA calls go through a :class:`HostRegistrar`, the one seam tests replace: the real
``cudaHostRegister`` cannot run without a GPU, and a CPU test counts the calls and bytes with a
registrar of its own (tests/unit/test_pinning.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from ..errors import SharedMemoryFullError, StagingError
from .segment import ShmSegment

log = logging.getLogger(__name__)

# Bytes registered per call: small enough that a save waits for little beyond its own bytes, large
# enough that the calls stay few. A cudaHostRegister (~150 ms per 256 MiB chunk on the H100
# machine) appears to hold the driver: saves made while one ran stalled 0.14-0.18 s there, 0.02 s
# after, which is why a new ring's pinning starts only after the first save's device snapshot was
# taken (ckptd.client.rankring).
CHUNK_NBYTES = 256 << 20
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not only the caller's
_JOIN_S = 30.0  # closing: how long to wait for a registration under way (one chunk: well under 1 s)


class HostRegistrar(Protocol):
    """Page-locks host memory for DMA (``cudaHostRegister``) and releases it again."""

    def register(self, address: int, nbytes: int) -> None:
        """Register ``[address, address + nbytes)``; raises StagingError on failure."""

    def unregister(self, address: int) -> None:
        """Release the registration starting at ``address``."""


class CudaRegistrar:
    """The real registrar: ``cudaHostRegister(..., cudaHostRegisterPortable)`` on the device that
    was current on the thread that made it (the pinner thread makes it current there first: a
    thread's current device defaults to 0, and a call on device 0 would create a CUDA context there
    for a rank training on another GPU)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._local = threading.local()

    def _ready(self) -> None:
        import torch

        if getattr(self._local, "device", None) != self.device:
            torch.cuda.set_device(self.device)
            self._local.device = self.device

    def register(self, address: int, nbytes: int) -> None:
        import torch

        self._ready()
        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
        if err != 0:
            raise StagingError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed with CUDA error {err}")

    def unregister(self, address: int) -> None:
        import torch

        with torch.cuda.device(self.device):  # on the closing thread: its own device is restored
            torch.cuda.cudart().cudaHostUnregister(address)


def cuda_registrar(device: Any = None) -> HostRegistrar | None:
    """A registrar for DMA from ``device`` (a save's CUDA device; default: the current one) when
    this process uses CUDA already (None otherwise: a CPU-only trainer on a GPU machine must not
    create a CUDA context just to pin a ring it never copies into by DMA)."""
    import torch

    if not (torch.cuda.is_initialized() and torch.cuda.is_available()):
        return None
    index = None if device is None else torch.device(device).index
    return CudaRegistrar(torch.cuda.current_device() if index is None else index)


class RingPinner:
    """Registers the data region of a ring (``capacity`` bytes at byte ``data_at`` of ``segment``)
    chunk by chunk in a thread of its own; tells which chunks are registered, waits for one.

    Order of use: :meth:`start` (the thread allocates and registers chunk 0, 1, ... in ring order);
    :meth:`pinned` / :meth:`wait` for a data range inside one chunk (:meth:`chunk_end`);
    :meth:`close` before the segment is unmapped (stops the thread, unregisters every chunk).
    A failure (``/dev/shm`` full, the registration refused) stops the pinning: :attr:`error` says
    why, the chunks registered so far stay usable, and waits for the others return False at once.
    """

    def __init__(
        self,
        segment: ShmSegment,
        data_at: int,
        capacity: int,
        registrar: HostRegistrar,
        chunk_nbytes: int = CHUNK_NBYTES,
        rank: int = 0,
    ) -> None:
        if segment.base is None:
            raise StagingError(f"segment {segment.name} is not mapped")
        self.segment = segment
        self.data_at = data_at
        self.capacity = capacity
        self.chunk_nbytes = chunk_nbytes
        self.registrar = registrar
        self.rank = rank
        self._address = segment.base.data_ptr() + data_at
        self.chunks = -(-capacity // chunk_nbytes)
        self._registered = [False] * self.chunks
        self._cond = threading.Condition()
        self._stop = False
        self._done = False  # the thread finished (every chunk registered, or stopped, or failed)
        self.error = ""
        self.pinned_s: float | None = None  # seconds the whole ring took, once pinned
        self._thread: threading.Thread | None = None

    # --- the training thread's side ----------------------------------------------------------
    def start(self) -> RingPinner:
        self._thread = threading.Thread(target=self._run, name=f"ckptd-pin-r{self.rank}", daemon=True)
        self._thread.start()
        return self

    def chunk_end(self, at: int) -> int:
        """The data offset where the chunk holding data offset ``at`` ends."""
        return min(self.capacity, (at // self.chunk_nbytes + 1) * self.chunk_nbytes)

    def pinned(self, at: int) -> bool:
        """Whether the chunk holding data offset ``at`` is registered."""
        return self._registered[at // self.chunk_nbytes]

    @property
    def complete(self) -> bool:
        return all(self._registered)

    @property
    def running(self) -> bool:
        """Whether chunks are still being registered (started, not finished, stopped or failed)."""
        return self._thread is not None and not (self._done or self._stop)

    def wait(self, at: int, timeout_s: float) -> bool:
        """Wait until the chunk holding data offset ``at`` is registered: True; False at once when
        it never will be (pinning failed or stopped); raises StagingError after ``timeout_s``."""
        i = at // self.chunk_nbytes
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._registered[i]:
                if self._done or self._stop:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingError(
                        f"rank {self.rank}: the staging ring's chunk {i} was not pinned within "
                        f"{timeout_s:g} s (CKPTD_SNAPSHOT_TIMEOUT_S)"
                    )
                self._cond.wait(min(left, 1.0))
        return True

    def close(self) -> None:
        """Stop pinning (a chunk under way finishes) and unregister every registered chunk."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(_JOIN_S)
            if thread.is_alive():  # a registration hangs in the driver: leave its pages pinned
                log.warning("rank %d: the staging ring's pinning thread did not stop in time", self.rank)
                return
        for i, done in enumerate(self._registered):
            if done:
                self._registered[i] = False
                try:
                    self.registrar.unregister(self._address + i * self.chunk_nbytes)
                except Exception as exc:  # noqa: BLE001 - closing: the pages go with the mapping anyway
                    log.warning("rank %d: unregistering staging chunk %d failed: %s", self.rank, i, exc)

    # --- the pinner thread ---------------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            for i in range(self.chunks):
                with self._cond:
                    if self._stop:
                        return
                at = i * self.chunk_nbytes
                n = min(self.chunk_nbytes, self.capacity - at)
                # Allocate first: cudaHostRegister faults the pages in, and on a full /dev/shm that
                # would be a SIGBUS or a driver error; posix_fallocate says ENOSPC.
                self.segment.reserve_range(self.data_at + at, n)
                self.registrar.register(self._address + at, n)
                with self._cond:
                    self._registered[i] = True
                    self._cond.notify_all()
            self.pinned_s = time.perf_counter() - t0
            log.info(
                "rank %d: staging ring pinned (%d bytes in %d chunks) in %.3f s",
                self.rank,
                self.capacity,
                self.chunks,
                self.pinned_s,
            )
        except Exception as exc:  # noqa: BLE001 - a CUDA RuntimeError too: said here, never a bare thread traceback
            self.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, (StagingError, OSError)) else str(exc)
            log.warning(
                "rank %d: pinning the staging ring stopped after %d of %d chunks: %s; CUDA tensors "
                "beyond them are staged through pageable memory (slow). %s",
                self.rank,
                sum(self._registered),
                self.chunks,
                exc,
                "Free /dev/shm or lower CKPTD_STAGING_BUDGET"
                if isinstance(exc, SharedMemoryFullError)
                else "Set CKPTD_PIN_MEMORY=0 to skip pinning",
            )
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
