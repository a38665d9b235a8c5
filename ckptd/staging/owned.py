"""What a lazy snapshot copies inside ``save()``: small tensors the attached optimizers do not own.

A lazy snapshot is fenced at the next ``optimizer.step()`` (``Checkpointer.attach``), which holds
for what only the optimizer writes: its parameters and its state. A model also holds tensors the
forward pass updates in place (BatchNorm's running statistics and ``num_batches_tracked`` in
training mode), which change before that fence: the lazy save of them fails, every time. So
with an optimizer attached, a saved tensor of at most :data:`SMALL_NBYTES` whose storage is not
one of an attached optimizer's parameters or state tensors is copied in ``save()`` (one
concatenation per device and dtype: a single kernel for all of them on a GPU, ordered on the
current stream before the forward pass that follows), up to :data:`TOTAL_NBYTES` per save. Large
tensors stay lazy: in mixed precision they are the model's low-precision parameters, which change
only after the step, from the optimizer's master copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch

from ..format.items import PlannedItem

SMALL_NBYTES = 1 << 20
TOTAL_NBYTES = 64 << 20


def _tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    for group in getattr(optimizer, "param_groups", ()):
        yield from (p for p in group.get("params", ()) if isinstance(p, torch.Tensor))
    for state in getattr(optimizer, "state", {}).values():
        if isinstance(state, dict):
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _storage_address(t: torch.Tensor) -> int | None:
    """Where ``t``'s values live: its storage's address, a DTensor's local tensor's (a saved
    DTensor's pieces are views of that; a DTensor's own storage has no address); None for a
    tensor without storage (a meta or other wrapper subclass)."""
    local = getattr(t, "_local_tensor", t)  # DTensor's, without the autograd view to_local() makes
    try:
        return int(local.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class OwnedStorages:
    """The storages of the attached optimizers' parameters and state tensors, by address; read
    again when an optimizer's state grew (its first step creates it)."""

    def __init__(self) -> None:
        self._sizes: tuple[int, ...] = ()
        self._ptrs: set[int] = set()

    def of(self, optimizers: Iterable[Any]) -> set[int]:
        optimizers = list(optimizers)
        sizes = tuple(len(getattr(o, "state", {})) for o in optimizers) + (len(optimizers),)
        if sizes != self._sizes:
            found = (_storage_address(t) for o in optimizers for t in _tensors(o))
            self._ptrs = {a for a in found if a is not None}
            self._sizes = sizes
        return self._ptrs


def copy_unowned(items: list[PlannedItem], owned: set[int]) -> list[PlannedItem]:
    """``items`` with the small tensors not in ``owned`` replaced by copies taken now."""
    groups: dict[tuple[Any, Any], list[tuple[int, torch.Tensor]]] = {}
    total = 0
    for i, item in enumerate(items):
        t = item.payload
        if not isinstance(t, torch.Tensor):
            continue
        nbytes = t.numel() * t.element_size()
        # the storage lookup last: about a microsecond, and only for small tensors
        if (
            0 < nbytes <= SMALL_NBYTES
            and total + nbytes <= TOTAL_NBYTES
            and t.untyped_storage().data_ptr() not in owned
        ):
            groups.setdefault((t.device, t.dtype), []).append((i, t))
            total += nbytes
    if not groups:
        return items
    out = list(items)
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for _, t in members])
            at = 0
            for i, t in members:
                out[i] = replace(items[i], payload=flat[at : at + t.numel()].view(t.shape), watch=None)
                at += t.numel()
    return out
