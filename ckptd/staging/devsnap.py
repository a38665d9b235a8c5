"""Device snapshots: a save made while the ring is still being pinned stalls for a device copy only.

Copying by DMA needs pinned host memory, and pinning a ring costs far more than the copy (about
0.6 s per GiB on the H100 machine, against 0.02 s per GiB for the copy): the first save of a job
that gave no size before it, or a save right after it, would wait for the pinner inside
``save()`` (:mod:`ckptd.staging.pinning`). Instead, while the ring's pinner still runs, such a
save copies its CUDA tensors into free device memory, a device-to-device copy at some 1.5 TB/s
queued on a stream of its own after the work queued before ``save()``, and the current stream
waits for that copy (not for the ring's copy stream, which may still be moving an earlier
snapshot to the host), so the kernels that follow (the optimizer's) cannot change a source before
it was read, with no host synchronisation at all. Host tensors are copied in ``save()``; bytes
are immutable. ``save()`` returns after the SAVE's round trip; a thread of the producer then
writes the snapshot into the ring exactly as ``save()`` would have (:func:`copy_inline`: DMA into
chunks as they are pinned, an explicit pageable copy if pinning fails), seals it, and frees the
device memory. The daemon fails the save if that thread fails or the process dies first, as for
any producer.

Whether a save takes this path is :func:`device_snapshot_fits`: the pinner still runs, and the
CUDA bytes fit in ``device_snapshot_fraction`` of the memory free on their device (the device's
free memory, not counting what torch's allocator holds for training already). Otherwise the save
waits for the pinner inside ``save()``, as before. The device memory is taken from torch's caching
allocator and returned to it (not to the driver) once the snapshot is in the ring.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from ..format.items import PlannedItem
from .devcopy import copy_inline, on_stream
from .producer import Claim, Snapshot, start_block
from .rankside import StagingRing, plain_values
from .ring import block_offset, give_up_mark

log = logging.getLogger(__name__)

# Host tensors a device snapshot copies inside save() at most (biases of a CPU-side module, an
# optimizer's step counters): beyond it the save is not taken on the devices.
HOST_COPY_MAX_NBYTES = 64 << 20


def tensor_nbytes_by_device(items: list[PlannedItem]) -> dict[Any, int]:
    """The bytes of a save's tensors per device (host tensors under ``torch.device("cpu")``)."""
    out: dict[Any, int] = {}
    for item in items:
        t = item.payload
        if isinstance(t, torch.Tensor):
            out[t.device] = out.get(t.device, 0) + t.numel() * t.element_size()
    return out


def device_snapshot_fits(
    pinning: bool, nbytes: Mapping[Any, int], free_nbytes: Mapping[Any, int], fraction: float
) -> bool:
    """Whether a save is snapshotted on its devices: the ring is still being pinned (``pinning``);
    the save has CUDA tensors (``nbytes``: per device, from :func:`tensor_nbytes_by_device`), which
    fit in ``fraction`` of the memory free on each of their devices (``free_nbytes``); and at most
    :data:`HOST_COPY_MAX_NBYTES` of host tensors, which are copied inside ``save()`` (a state held
    mostly on the host is written into the ring by ``save()`` as before, without a second copy)."""
    host = sum(n for d, n in nbytes.items() if d.type == "cpu")
    cuda = {d: n for d, n in nbytes.items() if d.type == "cuda"}
    if not pinning or fraction <= 0 or not cuda or host > HOST_COPY_MAX_NBYTES:
        return False
    return all(n <= fraction * free_nbytes.get(d, 0) for d, n in cuda.items())


def free_device_nbytes(devices: Iterable[Any]) -> dict[Any, int]:
    """Memory the driver has free on each device (``cudaMemGetInfo``)."""
    return {d: int(torch.cuda.mem_get_info(d)[0]) for d in devices if d.type == "cuda"}


def snapshot_on_device(ring: StagingRing, items: list[PlannedItem]) -> tuple[list[PlannedItem], dict[Any, Any]]:
    """Copies of the save's payloads taken now: CUDA tensors into one device buffer per device
    (on the ring's snapshot stream, after the work queued before; the current stream then waits
    for it), host tensors by a host copy, bytes as they are. Returns the items with these payloads
    (CUDA ones as flat uint8 views of the buffers, which is all the ring copies) and, per device,
    an event after the copies (what the copies into the ring wait for)."""
    out = list(items)
    by_device: dict[Any, list[tuple[int, torch.Tensor]]] = {}
    for i, item in enumerate(items):
        t = item.payload
        if isinstance(t, torch.Tensor):
            if t.is_cuda:
                by_device.setdefault(t.device, []).append((i, t))
            else:
                out[i] = PlannedItem(record=item.record, payload=plain_values(t).clone())
    ready: dict[Any, Any] = {}
    for device, tensors in by_device.items():
        current = torch.cuda.current_stream(device)
        stream = ring.snapshot_stream(device)
        stream.wait_stream(current)
        # Allocated on the current stream, used on the snapshot and copy streams (record_stream):
        # freed, it goes back to the pool training allocates from, once their work on it is done.
        buf = torch.empty(sum(t.numel() * t.element_size() for _, t in tensors), dtype=torch.uint8, device=device)
        buf.record_stream(stream)
        buf.record_stream(ring.side_stream(device))
        with on_stream(stream):
            srcs = [plain_values(t).reshape(-1).view(torch.uint8) for _, t in tensors]
            dsts, at = [], 0
            for src in srcs:
                dsts.append(buf[at : at + src.numel()])
                at += src.numel()
            torch._foreach_copy_(dsts, srcs)
            event = ready[device] = torch.cuda.Event()
            event.record(stream)
        current.wait_event(event)  # training's next kernels run after the snapshot read the sources
        for (i, _), dst in zip(tensors, dsts):
            out[i] = PlannedItem(record=items[i].record, payload=dst)
    return out, ready


class DeviceSnapshotProducer:
    """A :class:`~ckptd.staging.producer.Producer` for a save taken while the ring is pinned: the
    snapshot is taken on the devices at construction (in ``save()``, before the SAVE); after the
    SAVE_ACK a thread writes it into the ring (:func:`copy_inline`) and seals it.

    Before the ring is unmapped: :meth:`join` (bounded), or :meth:`stop` then :meth:`join`; a
    thread still running then may write into the ring, which must stay mapped."""

    def __init__(self, ring: StagingRing, claim: Claim, pin_timeout_s: float) -> None:
        self.ring = ring
        self.pin_timeout_s = pin_timeout_s
        self.items, self._ready = snapshot_on_device(ring, claim.items)
        # Without the save's own tensors: the producer outlives the save in RankRing's list, and
        # they (a split tensor's device copy among them) must not.
        self.claim = replace(claim, items=[])
        self.snapshot = Snapshot(
            pid=os.getpid(), seal=start_block(ring, claim.block), seal_offset=block_offset(claim.block)
        )
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def after_ack(self) -> float:
        self._thread = threading.Thread(
            target=self._run, name=f"ckptd-devsnap-r{self.ring.rank}-s{self.claim.step}", daemon=True
        )
        self._thread.start()
        return 0.0

    def cancel(self) -> None:
        """Nothing was written; the device copies go with this producer."""
        self.items = []

    def detach(self) -> None:
        """No answer to the SAVE: the daemon may have taken it, so the snapshot is written and
        sealed anyway (it commits if the daemon took it; else nobody reads the range, which stays
        reserved until the daemon frees it). Never left unsealed: the daemon would wait
        ``snapshot_timeout_s`` for it while this rank's later saves queue behind it."""
        self.after_ack()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread; whether it is done."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return not self.running

    def stop(self) -> None:
        """Closing: a wait for ring space gives up (the save fails); a copy under way finishes."""
        self._stop.set()

    def _run(self) -> None:
        c = self.claim
        try:
            for device in self._ready:  # the thread's current device: the save's (one device per rank)
                torch.cuda.set_device(device)
                break
            copy_inline(
                self.ring,
                c.start,
                c.block,
                self.items,
                c.placements,
                self.snapshot.seal,
                self.pin_timeout_s,
                ready=self._ready,
                stop=self._stop.is_set,
            )
        except Exception as exc:  # noqa: BLE001 - the block is marked given up: the daemon fails the save
            self.ring.writer.publish(c.block, give_up_mark(exc))  # copy_inline did, but not set_device
            log.warning(
                "rank %d: writing the device snapshot of step %d into the staging ring failed: %s: %s",
                self.ring.rank,
                c.step,
                type(exc).__name__,
                exc,
            )
        finally:
            self.items = []  # the device memory goes back to torch's allocator
            self._ready = {}
