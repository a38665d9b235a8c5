"""The rank side of staging: its ring of shared memory (:mod:`ckptd.staging.ring`) and the
layout of a save's items in it.

:func:`place` lays a save's items out one after the other (aligned offsets relative to the
save's start); :class:`StagingRing` owns the rank's ring, its pinning for CUDA
(:mod:`ckptd.staging.pinning`) and its side streams, and writes host items into it
(:meth:`StagingRing.produce`). CUDA tensors are copied by :mod:`ckptd.staging.devcopy`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import StagingError
from ..format.items import PlannedItem
from .backpressure import must_skip
from .pinning import CHUNK_NBYTES, HostRegistrar, RingPinner
from .ring import BLOCKS, HEADER_NBYTES, Placement, RingFull, RingWriter, span
from .segment import ShmSegment, new_generation, segment_name

log = logging.getLogger(__name__)

ALIGN_NBYTES = 64


def plain_cpu_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are exactly its ``numel * element_size`` bytes at ``data_ptr()``."""
    # is_cpu rather than device.type: a save checks every item, and device builds a new object.
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.is_cpu
        and t.layout == torch.strided
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def plain_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a tensor whose memory holds exactly them (conjugate and negative bits
    resolved, contiguous); ``t`` itself when it is one already. Same device."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a :func:`plain_cpu_bytes` tensor, without a copy: the view does not keep
    ``t`` alive, so the caller must hold ``t`` until it is done with the view."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def payload_nbytes(payload: torch.Tensor | bytes) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return len(payload)


def place(items: list[PlannedItem]) -> tuple[list[Placement], int]:
    """Aligned offsets of ``items`` relative to their save's start, and the bytes they take."""
    out, offset = [], 0
    for item in items:
        n = payload_nbytes(item.payload)
        out.append(Placement(offset, n))
        offset += -(-n // ALIGN_NBYTES) * ALIGN_NBYTES
    return out, offset


def bytes_view(raw: memoryview, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A tensor of ``dtype``/``shape`` over ``raw`` (no copy)."""
    if raw.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)


class StagingRing:
    """A rank's staging ring (:mod:`ckptd.staging.ring`): one segment of ``HEADER_NBYTES +
    capacity`` bytes named ``<prefix>r<rank>-<generation>-s0``, the saves it streams, and the
    control blocks free for the next ones.

    Order of use (training thread): :meth:`create` (once the size of a save is known; sized by the
    staging budget), :meth:`start_pinning` when CUDA tensors will be copied into it, then per save
    :meth:`claim` a control block and the save's virtual range, produce its items into the ring (a
    :class:`~ckptd.staging.producer.Producer`: fork child, lazy copier or inline copy), get the block
    back from the daemon's WRITE_DONE (:meth:`release`; :meth:`unclaim` if the daemon never took
    the save); :meth:`close` unpins and unmaps (and unlinks only a segment no daemon took over).
    """

    def __init__(
        self, prefix: str, rank: int, capacity: int, segment: ShmSegment, generation: str, timeout_s: float
    ) -> None:
        self.prefix = prefix
        self.rank = rank
        self.capacity = capacity
        self.segment = segment
        self.generation = generation
        self.pinner: RingPinner | None = None
        # Device-to-host copies into this ring so far: by DMA into pinned chunks, and through
        # pageable memory (no pinned chunk: pinning off or failed). ckptd.staging.devcopy counts.
        self.dma_pieces = 0
        self.pageable_pieces = 0
        self.writer = RingWriter(segment.fileno(), capacity, timeout_s)
        self._free_blocks: list[int] = list(range(BLOCKS))  # control blocks not in use
        self.next_start = 0  # virtual offset of the next save
        self._streams: dict[Any, Any] = {}
        self._snapshot_streams: dict[Any, Any] = {}

    @property
    def names(self) -> list[str]:
        return [self.segment.name]

    @classmethod
    def create(cls, prefix: str, rank: int, capacity: int, timeout_s: float) -> StagingRing:
        """A new, sparse ring (nothing is allocated but its header page; nothing is pinned)."""
        generation = new_generation()
        segment = ShmSegment.create(segment_name(prefix, rank, generation, 0), HEADER_NBYTES + capacity)
        try:
            segment.write(0, bytes(HEADER_NBYTES))  # the header's page is allocated from here on
            ring = cls(prefix, rank, capacity, segment, generation, timeout_s)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        log.info("rank %d: staging ring %s: %d bytes", rank, generation, capacity)
        return ring

    def start_pinning(self, registrar: HostRegistrar, chunk_nbytes: int | None = None) -> None:
        """Pin the ring's data region in the background, chunk by chunk (ckptd.staging.pinning);
        CUDA copies use each chunk once it is pinned. Does nothing when pinning started already."""
        if self.pinner is None:
            chunk = chunk_nbytes or CHUNK_NBYTES
            self.pinner = RingPinner(self.segment, HEADER_NBYTES, self.capacity, registrar, chunk, self.rank).start()

    @property
    def pinned(self) -> bool:
        """Whether the whole ring is pinned (every chunk registered)."""
        return self.pinner is not None and self.pinner.complete

    @property
    def chunk_nbytes(self) -> int:
        """Pinned chunk size: a device-to-host copy never spans two chunks."""
        return self.pinner.chunk_nbytes if self.pinner is not None else CHUNK_NBYTES

    def has_free_block(self) -> bool:
        """Whether a control block is free (fewer than BLOCKS saves of this rank in flight)."""
        return bool(self._free_blocks)

    def claim(self, placements: list[Placement]) -> tuple[int, int]:
        """A free control block and the virtual start of a save laid out as ``placements``."""
        block = self._free_blocks.pop(0)
        start = self.next_start
        self.next_start += span(p.offset + p.nbytes for p in placements)
        return block, start

    def unclaim(self, block: int, start: int, placements: list[Placement]) -> None:
        """Give back what :meth:`claim` took for a save the daemon never received."""
        if self.next_start == start + span(p.offset + p.nbytes for p in placements):
            self.next_start = start
        self.release(block)

    def release(self, block: int) -> None:
        """The daemon wrote the save of control ``block`` out (its WRITE_DONE)."""
        if not 0 <= block < BLOCKS:
            log.warning("rank %d: the node daemon released control block %d, which no ring has", self.rank, block)
            return
        if block not in self._free_blocks:
            self._free_blocks.append(block)

    def must_skip(self, placements: list[Placement]) -> bool:
        """``on_full="skip"``: whether earlier saves hold the ring so that the next save, laid out as
        ``placements``, must be skipped (:func:`ckptd.staging.backpressure.must_skip`: never on an
        idle ring, whatever the save's size)."""
        start = self.next_start
        return must_skip(
            free_block=self.has_free_block(),
            consumed=self.writer.consumed(),
            start=start,
            end=start + span(p.offset + p.nbytes for p in placements),
            capacity=self.capacity,
        )

    def check_room(self, start: int, placements: list[Placement]) -> None:
        """Raise StagingError now if /dev/shm cannot hold the ring pages this save needs (see
        :meth:`ShmSegment.check_room`)."""
        end = HEADER_NBYTES + start % self.capacity + span(p.offset + p.nbytes for p in placements)
        self.segment.check_room(min(end, self.segment.nbytes))

    def wait_room(self, v_end: int, stop: Callable[[], bool] | None = None) -> float:
        """Return once ``[.., v_end)`` may be written (the seconds waited). Raises StagingError when
        the daemon made no room for ``snapshot_timeout_s``, or at once when ``stop()`` (closing)."""
        writer = self.writer
        if stop is not None:
            writer = writer.watching(lambda: not stop())
        try:
            return writer.wait_room(v_end)
        except RingFull as exc:
            if stop is not None and stop():
                raise StagingError(
                    f"rank {self.rank}: gave up waiting for ring space: the Checkpointer is closing, or "
                    "the node daemon that frees it is gone"
                ) from None
            raise StagingError(
                f"rank {self.rank}: {exc} (CKPTD_SNAPSHOT_TIMEOUT_S); the node daemon is not persisting: see its log"
            ) from None

    def check_size(self, item: PlannedItem, p: Placement) -> None:
        """StagingError unless tensor ``item`` still has the bytes planned for it: one resized since
        ``save()`` (``resize_``) would write past its range, over an earlier save's bytes the
        daemon has not persisted yet."""
        src = item.payload
        if isinstance(src, torch.Tensor) and src.numel() * src.element_size() != p.nbytes:
            raise StagingError(
                f"rank {self.rank}: {item.record.where()} has {src.numel() * src.element_size()} bytes, "
                f"but {p.nbytes} when it was saved: it was resized (resize_) before its snapshot was "
                "copied. Fence the save (handle.wait(), before_update()) before resizing a saved tensor"
            )

    def produce(self, item: PlannedItem, p: Placement, v: int) -> None:
        """Write one item's bytes at virtual offset ``v`` (room already waited for)."""
        src = item.payload
        self.check_size(item, p)
        try:
            if not isinstance(src, torch.Tensor):
                self.writer.write(v, memoryview(src).cast("B"))
            elif p.nbytes:
                self._write_tensor(src, v)
        except OSError as exc:
            raise self.segment.write_failed(exc, p.nbytes) from exc
        except Exception as exc:  # a tensor subclass or device may refuse; name the item
            raise StagingError(
                f"rank {self.rank}: copying {item.record.where()} into the staging ring "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _write_tensor(self, src: torch.Tensor, v: int) -> None:
        # Not CUDA tensors (ckptd.staging.devcopy); another device's are copied to the host first.
        values = src if plain_cpu_bytes(src) else plain_values(src).cpu()  # alive until written
        self.writer.write(v, tensor_bytes(values))

    def side_stream(self, device: torch.device) -> Any:
        """This ring's copy stream on ``device`` (one per device, reused by every save)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    def snapshot_stream(self, device: torch.device) -> Any:
        """The stream device snapshots are copied on (ckptd.staging.devsnap): not the copy stream,
        which may still be busy with an earlier snapshot's device-to-host copies that training's
        stream must not wait for."""
        stream = self._snapshot_streams.get(device)
        if stream is None:
            stream = self._snapshot_streams[device] = torch.cuda.Stream(device=device)
        return stream

    def order_after_copies(self) -> None:
        """Make each device's current stream wait for this ring's copy stream there: the work queued
        next (the optimizer's kernels) runs after the copies issued so far, without the host waiting."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def close(self, unlink: bool) -> None:
        """Unmap the ring; ``unlink`` only when no daemon owns the segment."""
        try:
            if self.pinner is not None:
                self.pinner.close()  # before the pages are unmapped
                self.pinner = None
        finally:
            self.writer.close()
            self.segment.close()
            if unlink:
                self.segment.unlink()
