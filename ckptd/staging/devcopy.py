"""Device-to-host copies of one save's CUDA tensors into a rank's staging ring, at the DMA floor.

The copies run on a side stream per device that first waits for the work queued before the save
(so they read what training wrote), by DMA into ring chunks that are pinned already
(:mod:`ckptd.staging.pinning`). The thread producing the save only *issues* copies; it waits for
them once, at the end (``snapshot="auto"``/``"copy"``: :meth:`DeviceCopier.finish`), or not at all
(``snapshot="lazy"``: the fence orders the next kernels after them). What a tensor costs beyond
its bytes is kept small, because a real state dict holds hundreds of tensors of mixed sizes:

- no host synchronisation per tensor: copies are queued back to back with an event after each,
  and the save's progress (what the daemon may write) is published as those events complete;
- one stream dependency per device and save, not one per tensor;
- consecutive small tensors (under :data:`SMALL_NBYTES`: biases, norms, fused AdamW's
  per-parameter step counters...) are gathered on the device into one buffer laid out as in the
  ring (``torch._foreach_copy_``, one kernel) and copied by one DMA;
- a copy never spans two pinned chunks or the ring's end: it is split into pieces there.

A piece whose chunk is not pinned yet waits for the pinner; one that never will be (pinning off
or failed) is copied by an explicit, synchronous device-to-host copy into pageable memory and
written with ``pwrite``: never a "non-blocking" DMA into unregistered pages, which the driver
would silently turn into a slow pageable copy.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import StagingError
from ..format.items import PlannedItem
from .producer import Claim, Snapshot, process_alive, start_block
from .rankside import Placement, StagingRing, plain_values, tensor_bytes
from .ring import ALIGN, HEADER_NBYTES, block_offset, give_up_mark


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """``torch.cuda.stream(stream)`` with ``stream``'s device current meanwhile. Leaving a stream
    context restores the stream of the thread's current device: on a thread whose current device
    is not the stream's (a new thread's is 0; so is that of a trainer that names its GPU in its
    tensors only) that sets the device, and setting device 0 creates a CUDA context there, for a
    rank that trains on another GPU."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield


# Tensors smaller than this are gathered with their neighbours into one copy (a DMA of a few
# bytes costs as much as one of 1 MiB: its launch and completion, ~10 us).
SMALL_NBYTES = 1 << 20
BATCH_NBYTES = 32 << 20


def ring_pieces(v: int, nbytes: int, capacity: int, chunk_nbytes: int) -> list[tuple[int, int, int]]:
    """``(source offset, data offset, nbytes)`` pieces of virtual ``[v, v + nbytes)``: split where
    the ring wraps and where a pinned chunk ends, so that each piece is one DMA into one chunk."""
    out = []
    done = 0
    while done < nbytes:
        at = (v + done) % capacity
        end = min(capacity, (at // chunk_nbytes + 1) * chunk_nbytes)
        n = min(nbytes - done, end - at)
        out.append((done, at, n))
        done += n
    return out


@dataclass
class _Batch:
    """Consecutive small tensors of one device, to be copied by one DMA (see module docstring)."""

    device: torch.device
    start: int  # virtual offset of the first
    end: int = 0  # virtual end of the last
    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (virtual offset, uint8 source)


class DeviceCopier:
    """Produces one save's items into the ring from the thread that copies them (the training
    thread inside ``save()``, or the lazy copier thread).

    Order of use: :meth:`produce` the save's items (per item in ring order, :meth:`copy` for a
    CUDA tensor, :meth:`room`, a host write and :meth:`wrote` for the rest); then :meth:`finish`
    (waits until every copy landed and publishes the save's progress), or :meth:`flush` and later
    :meth:`land` (lazy: the fence needs only every copy *issued*); :meth:`abort` on failure.
    ``ready`` (lazy) holds an event per device recorded at ``save()``, which the copies wait for
    instead of the current streams; a wait for ring space gives up at once when ``stop()``
    (closing), and ``cancel()`` true before an item stops the copy there. :attr:`waited_s` is the
    time spent waiting for ring space or pinning.
    """

    def __init__(
        self,
        ring: StagingRing,
        block: int,
        pin_timeout_s: float,
        ready: dict[Any, Any] | None = None,
        stop: Callable[[], bool] | None = None,
        cancel: Callable[[], bool] | None = None,
    ) -> None:
        self.ring = ring
        self.block = block
        self.pin_timeout_s = pin_timeout_s
        self.ready = ready
        self.stop = stop
        self.cancel = cancel  # checked before each item (the lazy copier: stop copying at once)
        self.waited_s = 0.0
        self._streams: dict[Any, Any] = {}
        self._device_current = False  # whether the one device copied from is this thread's current one
        self._landing: deque[tuple[Any, int]] = deque()  # (event or None, virtual end), in ring order
        self._batch: _Batch | None = None

    # --- producing -----------------------------------------------------------------------------
    def produce(
        self, start: int, items: list[PlannedItem], placements: list[Placement], first: int = 0, wait: bool = True
    ) -> int:
        """Issue the items of a save starting at virtual ``start`` from item ``first`` on, in ring
        order: CUDA tensors by :meth:`copy`, bytes and host tensors by ``pwrite`` once the ring has
        room. ``wait=False`` stops before the first item the ring has no room for yet (before the
        SAVE is sent the daemon does not drain this save, so waiting could never end). Returns
        the index of the first item not issued (``len(items)`` when all were). A failure is raised
        as StagingError naming the item."""
        ring = self.ring
        for index in range(first, len(items)):
            if self.cancel is not None and self.cancel():
                # Closing (the save was abandoned at its deadline), or the daemon is gone: copying
                # on would read the trainer's tensors after close() returned.
                raise StagingError(
                    f"rank {ring.rank}: the copy stopped before {items[index].record.where()}: the "
                    "Checkpointer was closed or its node daemon is gone"
                )
            item, p = items[index], placements[index]
            v = start + p.offset
            if not wait and not ring.writer.has_room(v + p.nbytes):
                return index
            src = item.payload
            if isinstance(src, torch.Tensor) and src.is_cuda:
                ring.check_size(item, p)
                try:
                    self.copy(src, v)
                except StagingError:
                    raise
                except OSError as exc:  # a write of the pageable path: a full /dev/shm says so
                    raise ring.segment.write_failed(exc, p.nbytes) from exc
                except Exception as exc:  # name the item, as StagingRing.produce does
                    raise StagingError(
                        f"rank {ring.rank}: copying {item.record.where()} into the staging ring "
                        f"failed: {type(exc).__name__}: {exc}"
                    ) from exc
            else:
                self.room(v + p.nbytes)
                ring.produce(item, p, v)
                self.wrote(v + p.nbytes)
        return len(items)

    def copy(self, src: torch.Tensor, v: int) -> None:
        """Queue the copy of CUDA tensor ``src`` to virtual offset ``v``."""
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            self.wrote(v)
            return
        stream = self._stream(src.device)
        with self._on(stream):  # a non-contiguous source is made contiguous after the wait
            flat = plain_values(src).reshape(-1).view(torch.uint8)
        if nbytes < SMALL_NBYTES:
            batch = self._batch
            if batch is None or not self._joins_batch(batch, src.device, v, nbytes):
                self.flush()
                batch = self._batch = _Batch(src.device, v)
            batch.parts.append((v, flat))
            batch.end = v + nbytes
            return
        self.flush()
        self._copy_flat(stream, flat, v)

    def room(self, v_end: int) -> None:
        """Wait until the ring may be written up to virtual ``v_end``. Copies issued but not
        published yet hold the daemon back, so they are waited for and published first."""
        if self.ring.writer.has_room(v_end):
            return
        self.land()
        self.waited_s += self.ring.wait_room(v_end, self.stop)

    def wrote(self, v_end: int) -> None:
        """A host write ending at virtual ``v_end`` is done: publish it once earlier copies landed."""
        self.flush()
        self._landing.append((None, v_end))
        self._publish_landed()

    def flush(self) -> None:
        """Issue the gathered small tensors' copy (every copy is issued once this returns)."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        stream = self._stream(batch.device)
        with self._on(stream):
            buf = torch.zeros(batch.end - batch.start, dtype=torch.uint8, device=batch.device)
            dsts = [buf[v - batch.start : v - batch.start + t.numel()] for v, t in batch.parts]
            srcs = [t for _, t in batch.parts]
            try:
                torch._foreach_copy_(dsts, srcs)
            except (AttributeError, RuntimeError):  # a torch without the fused copy
                for d, s in zip(dsts, srcs):
                    d.copy_(s)
        # buf was allocated on the side stream: the allocator reuses it only after the work
        # queued there, so dropping it after the copy below is issued is safe.
        self._copy_flat(stream, buf, batch.start)

    def finish(self) -> None:
        """Issue what is gathered, wait until every copy landed, publish the progress."""
        self.flush()
        for stream in self._streams.values():
            stream.synchronize()
        self._publish(self._landing[-1][1] if self._landing else 0)
        self._landing.clear()

    def land(self) -> None:
        """Wait for the issued copies in order, publishing the progress as each lands."""
        self.flush()
        while self._landing:
            event, end = self._landing.popleft()
            if event is not None:
                event.synchronize()
            self._publish(end)

    # --- internals -----------------------------------------------------------------------------
    def _on(self, stream: Any) -> Any:
        """The stream context for the copies on ``stream`` (see :func:`on_stream`; the device
        guard only where this thread's current device is another, as the check is per save)."""
        return torch.cuda.stream(stream) if self._device_current else on_stream(stream)

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            self._device_current = len(self._streams) == 0 and torch.cuda.current_device() == device.index
            stream = self._streams[device] = self.ring.side_stream(device)
            if self.ready is None:
                stream.wait_stream(torch.cuda.current_stream(device))
            else:
                stream.wait_event(self.ready[device])
        return stream

    def _joins_batch(self, b: _Batch, device: torch.device, v: int, nbytes: int) -> bool:
        if b.device != device or v - b.end >= ALIGN or v + nbytes - b.start > BATCH_NBYTES:
            return False
        cap, chunk = self.ring.capacity, self.ring.chunk_nbytes
        at = b.start % cap
        return at + (v + nbytes - b.start) <= min(cap, (at // chunk + 1) * chunk)  # one chunk, no wrap

    def _copy_flat(self, stream: Any, flat: torch.Tensor, v: int) -> None:
        """DMA ``flat`` (uint8, on ``stream``'s device) to virtual ``v``, piece by piece."""
        ring = self.ring
        base = ring.segment.base
        if base is None:
            raise StagingError(f"rank {ring.rank}: the staging ring is not mapped")
        for src_at, at, n in ring_pieces(v, flat.numel(), ring.capacity, ring.chunk_nbytes):
            end = v + src_at + n
            self.room(end)
            piece = flat[src_at : src_at + n]
            if self._pinned(at):
                with self._on(stream):
                    base[HEADER_NBYTES + at : HEADER_NBYTES + at + n].copy_(piece, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                ring.dma_pieces += 1
                self._landing.append((event, end))
                self._publish_landed()
            else:
                with self._on(stream):
                    host = piece.to("cpu")  # synchronous, after the stream's earlier work
                ring.writer.write(v + src_at, tensor_bytes(host))
                ring.pageable_pieces += 1
                self._landing.append((None, end))

    def _pinned(self, at: int) -> bool:
        pinner = self.ring.pinner
        if pinner is None:
            return False
        if pinner.pinned(at):
            return True
        t0 = time.monotonic()
        ok = pinner.wait(at, self.pin_timeout_s)
        self.waited_s += time.monotonic() - t0
        return ok

    def _publish_landed(self) -> None:
        end = -1
        while self._landing and (self._landing[0][0] is None or self._landing[0][0].query()):
            end = self._landing.popleft()[1]
        if end >= 0:
            self._publish(end)

    def _publish(self, end: int) -> None:
        if end > 0:
            self.ring.writer.publish(self.block, end)

    def abort(self) -> None:
        """A failed save: wait for the copies already issued (they must not land in ring space a
        later save reuses), ignoring their errors."""
        self._batch = None
        for stream in self._streams.values():
            try:
                stream.synchronize()
            except RuntimeError:
                pass
        self._landing.clear()


def copy_inline(
    ring: StagingRing,
    start: int,
    block: int,
    items: list[PlannedItem],
    placements: list[Placement],
    seal: bytes,
    pin_timeout_s: float | None = None,
    ready: dict[Any, Any] | None = None,
    stop: Callable[[], bool] | None = None,
) -> float:
    """Produce every item of a save here, in ``save()`` (``snapshot="copy"``, or CUDA tensors),
    then seal; returns the seconds spent waiting for ring space or for the ring's pinning. Bytes
    and CPU tensors by ``pwrite``, CUDA tensors by :class:`DeviceCopier`. On failure the save is
    marked never to be sealed (the daemon fails it) and the error is raised. A chunk not pinned yet
    is waited for up to ``pin_timeout_s`` (default: the ring's ``snapshot_timeout_s``). ``ready``:
    per device, the event the copies wait for (default: the work queued on the current stream);
    ``stop()`` true: a wait for ring space gives up (closing)."""
    timeout_s = ring.writer.timeout_s if pin_timeout_s is None else pin_timeout_s
    copier = DeviceCopier(ring, block, timeout_s, ready=ready, stop=stop)
    return _produce_and_seal(copier, start, items, placements, seal)


def _produce_and_seal(
    copier: DeviceCopier, start: int, items: list[PlannedItem], placements: list[Placement], seal: bytes, first: int = 0
) -> float:
    """Issue the items from ``first`` on, wait until every copy landed and seal; on failure mark
    the save never to be sealed and raise. The seconds spent waiting for ring space or pinning."""
    writer = copier.ring.writer
    try:
        copier.produce(start, items, placements, first=first)
        copier.finish()
    except BaseException as exc:
        copier.abort()
        writer.publish(copier.block, give_up_mark(exc))
        raise
    writer.seal(copier.block, seal)
    return copier.waited_s


class InlineProducer:
    """A :class:`~ckptd.staging.producer.Producer` that is ``save()`` itself. When made, before
    the SAVE is sent, it issues the copies of the items the ring has room for already (CUDA
    tensors: DMA on the side stream, so the copies run during the SAVE's round trip instead of
    after it; bytes and host tensors: ``pwrite``); after the SAVE_ACK it issues the rest as the
    daemon drains the ring, waits until every copy landed, publishes and seals
    (:meth:`after_ack`). A save the daemon never took waits for the copies issued before its
    range is given back."""

    def __init__(self, ring: StagingRing, claim: Claim, pin_timeout_s: float, daemon_pid: int | None = None) -> None:
        self.ring = ring
        self.claim = claim
        self.snapshot = Snapshot(
            pid=os.getpid(), seal=start_block(ring, claim.block), seal_offset=block_offset(claim.block)
        )
        # A wait for ring space gives up at once when the node daemon (which frees it) is gone.
        alive = None if daemon_pid is None else process_alive(daemon_pid)
        stop = None if alive is None else (lambda: not alive())
        self._copier = DeviceCopier(ring, claim.block, pin_timeout_s, stop=stop)
        try:
            self._issued = self._copier.produce(claim.start, claim.items, claim.placements, wait=False)
        except BaseException:
            self._copier.abort()  # nothing lands in the range after it is given back
            raise

    def after_ack(self) -> float:
        c = self.claim
        return _produce_and_seal(self._copier, c.start, c.items, c.placements, self.snapshot.seal, first=self._issued)

    def cancel(self) -> None:
        """Wait for the copies issued: the caller gives the range back."""
        self._copier.abort()

    def detach(self) -> None:
        """No answer to the SAVE: the copies issued land, and the block is marked given up, so a
        daemon that did take the save fails it at once, rather than waiting ``snapshot_timeout_s``
        for a seal that never comes while this rank's later saves queue behind it."""
        self._copier.abort()
        self.ring.writer.publish(self.claim.block, give_up_mark(None))
