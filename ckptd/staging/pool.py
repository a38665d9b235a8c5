"""The rank side of staging: a reusable pool of shared-memory slots and the copy into a slot.

Order of use (all on the training rank, single-threaded):

1. :func:`place` lays a save's items out in one slot (aligned offsets);
2. :meth:`StagingPool.create` allocates ``nslots`` slots once, sized from the first save and
   pre-faulted; on CUDA each slot is registered as pinned memory (``cudaHostRegister``);
3. :meth:`StagingPool.stage` copies the items into a free slot: device-to-host DMA on a side
   stream on CUDA, a memcpy on CPU; it returns once the bytes are in the slot, so the caller may
   mutate its tensors right after;
4. :meth:`StagingPool.close` unmaps (and unlinks only segments no daemon took over).
"""

from __future__ import annotations

import ctypes
import logging
import math
from typing import Any, NamedTuple

import torch

from ..errors import StagingError
from ..format.items import PlannedItem
from .segment import ShmSegment, new_generation, segment_name

log = logging.getLogger(__name__)

ALIGN_NBYTES = 64
_PAGE = 4096


def plain_cpu_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are exactly its ``numel * element_size`` bytes at ``data_ptr()``."""
    # is_cpu rather than device.type: a save checks every item, and device builds a new object.
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cpu
            and t.layout == torch.strided and t.is_contiguous() and not t.is_conj() and not t.is_neg())


class Placement(NamedTuple):
    """Where an item's bytes lie in a slot. A tuple: a save makes and compares one per item, and
    tuples are built and compared in C (a frozen dataclass costs ~1 us per item more)."""

    offset: int
    nbytes: int


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a :func:`plain_cpu_bytes` tensor, without a copy (valid while ``t`` lives)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def payload_nbytes(payload: torch.Tensor | bytes) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return len(payload)


def place(items: list[PlannedItem]) -> tuple[list[Placement], int]:
    """Aligned offsets of ``items`` in a slot, and the bytes the slot needs."""
    out, offset = [], 0
    for item in items:
        n = payload_nbytes(item.payload)
        out.append(Placement(offset, n))
        offset += -(-n // ALIGN_NBYTES) * ALIGN_NBYTES
    return out, offset


def slot_view(base: torch.Tensor, p: Placement, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over the slot bytes at ``p`` (no copy)."""
    if p.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return base[p.offset : p.offset + p.nbytes].view(dtype).view(shape)


def slot_size_for(nbytes: int, headroom: float) -> int:
    """Slot size for a first save of ``nbytes``: plus headroom, rounded up to whole pages."""
    want = max(1, math.ceil(nbytes * (1.0 + headroom)) + (1 << 20 if headroom > 0 else 0))
    return -(-want // _PAGE) * _PAGE


class StagingPool:
    """``nslots`` equally sized segments named ``<prefix>r<rank>-<generation>-s<i>``."""

    def __init__(self, prefix: str, rank: int, slot_nbytes: int, segments: list[ShmSegment],
                 generation: str, pinned: bool) -> None:
        self.prefix = prefix
        self.rank = rank
        self.slot_nbytes = slot_nbytes
        self.segments = segments
        self.generation = generation
        self.pinned = pinned
        self.free: list[int] = list(range(len(segments)))
        self._streams: dict[Any, Any] = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.segments]

    @classmethod
    def create(cls, prefix: str, rank: int, nslots: int, slot_nbytes: int, pin: bool) -> "StagingPool":
        generation = new_generation()
        segments: list[ShmSegment] = []
        try:
            for i in range(nslots):
                segments.append(ShmSegment.create(segment_name(prefix, rank, generation, i), slot_nbytes))
        except BaseException:
            for s in segments:
                s.close()
                s.unlink()
            raise
        pool = cls(prefix, rank, slot_nbytes, segments, generation, pinned=False)
        if pin and torch.cuda.is_available():
            pool._pin()
        log.info("rank %d: staging pool %s: %d slots of %d bytes%s", rank, generation, nslots,
                 slot_nbytes, " (pinned)" if pool.pinned else "")
        return pool

    def _pin(self) -> None:
        cudart = torch.cuda.cudart()
        for seg in self.segments:
            if seg.base is None:
                continue
            seg.reserve()  # registering faults every page in: a full /dev/shm must fail cleanly
            err = cudart.cudaHostRegister(seg.base.data_ptr(), seg.nbytes, 0)
            if int(err) != 0:
                raise StagingError(f"cudaHostRegister of {seg.path} ({seg.nbytes} bytes) failed "
                                   f"with CUDA error {int(err)}; set CKPTD_PIN_MEMORY=0 to stage unpinned")
        self.pinned = True

    def _unpin(self) -> None:
        if not self.pinned:
            return
        cudart = torch.cuda.cudart()
        for seg in self.segments:
            if seg.base is not None:
                cudart.cudaHostUnregister(seg.base.data_ptr())
        self.pinned = False

    def stage(self, slot: int, items: list[PlannedItem], placements: list[Placement]) -> None:
        """Copy every item's payload into ``slot``; returns when all bytes are there.

        Bytes and plain CPU tensors are written with ``pwrite`` (a full ``/dev/shm`` is a
        StagingError, never a SIGBUS); other tensors (CUDA, strided) are copied through the
        mapping, after the slot was reserved (:meth:`ShmSegment.reserve`).
        """
        seg = self.segments[slot]
        base = seg.base
        if base is None:
            raise StagingError(f"rank {self.rank}: staging slot {slot} is not mapped")
        last = placements[-1] if placements else None
        if last is not None and last.offset + last.nbytes > self.slot_nbytes:
            raise StagingError(f"rank {self.rank}: save needs {last.offset + last.nbytes} bytes, "
                               f"slot holds {self.slot_nbytes}")
        if last is not None:
            seg.check_room(last.offset + last.nbytes)
        pending_streams = []
        # On failure too: no device-to-host copy may still be landing in a slot given back.
        try:
            for item, p in zip(items, placements):
                src = item.payload
                if not isinstance(src, torch.Tensor):
                    seg.write(p.offset, src)
                elif plain_cpu_bytes(src):
                    if p.nbytes:
                        seg.write(p.offset, tensor_bytes(src))
                else:
                    seg.reserve()
                    try:
                        stream = self._copy_tensor(src, slot_view(base, p, src.dtype, src.shape))
                    except Exception as exc:  # a tensor subclass or device may refuse; name the item
                        raise StagingError(f"rank {self.rank}: copying {item.record.where()} into staging "
                                           f"slot {slot} failed: {type(exc).__name__}: {exc}") from exc
                    if stream is not None and stream not in pending_streams:
                        pending_streams.append(stream)
        finally:
            for stream in pending_streams:
                stream.synchronize()

    def _copy_tensor(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        """Copy ``src`` into the slot view ``dst``; returns the CUDA stream still copying, if any."""
        if src.device.type != "cuda":
            dst.copy_(src)
            return None
        stream = self._side_stream(src.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return stream

    def _side_stream(self, device: torch.device) -> Any:
        """A copy stream per device that first waits for the work already queued on the current one."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def close(self, unlink: bool) -> None:
        """Unmap every slot; ``unlink`` only when no daemon owns the segments."""
        try:
            self._unpin()
        finally:
            for seg in self.segments:
                seg.close()
                if unlink:
                    seg.unlink()
