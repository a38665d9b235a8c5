"""Which rank writes each plain item of a DCP-style state dict (pure functions, no I/O).

A DCP-style state dict's plain tensors and values (``torch.Tensor``, numbers, strings, any other
non-DTensor leaf) are whole items, and any set of ranks may hold one: every rank (replicated
buffers, an iteration number), only rank 0 (``get_state_dict(..., full_state_dict=True,
cpu_offload=True)``), or one rank alone (TorchTitan's per-rank dataloader state). torch DCP plans
every rank's items and writes an item held by several ranks once, by one of its holders
(``torch/distributed/checkpoint/_dedup_save_plans.py``). ckptd stores the same set of items; who
writes each is :func:`assign_writers`, a function of who holds what:

- a key held by one rank goes to that rank, a value to the lowest rank holding it;
- tensors held by several ranks, largest first, each to its least loaded holder (bytes of the
  shared tensors assigned so far; ties to the lowest rank).

Where ranks hold different copies under one key, the copy stored is that writer's: the lowest
holding rank's for a value, the size-balanced holder's for a tensor, the same in every kind of
save (:func:`ckptd.save`, a Checkpointer writing every copy, a Checkpointer spreading them).

A synchronous save exchanges its ranks' holdings in the planning round and assigns writers
globally. An asynchronous save has no collective: until a rank knows that every rank holds the
same plain keys, it writes every plain item it holds and the coordinator keeps one copy per key
(:func:`ckptd.format.coverage.dedup_plain`); its SAVE carries :func:`plain_digest` of its keys,
and the commit's verdict says whether every rank sent the same digest. A rank whose digest was
confirmed so writes only its share (:func:`spread`, which is :func:`assign_writers` when every
rank holds every key) while its digest stays the same (:class:`PlainWriters`). If another rank's
keys changed meanwhile, a key may be left to a rank that no longer holds it: the coordinator's
coverage check refuses that commit, naming the key (:mod:`ckptd.format.coverage`), and every rank
writes all it holds again until a verdict confirms them.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack

if TYPE_CHECKING:
    import torch

    from ..mapping import ShardedTensor
    from .split import SplitStateDict

# ckptd.mapping and .split (torch) are imported where a rank uses them: the node daemon assigns
# writers with this module and never imports torch.

VALUE = -1  # the size a holding gives for a value (a bytes item): values go to the lowest holder

Holdings = Mapping[str, Mapping[int, int]]  # key -> {holding rank: tensor bytes, or VALUE}


def assign_writers(holdings: Holdings) -> dict[str, int]:
    """The rank that writes each key: a key held by one rank that rank; a value its lowest holder;
    tensors held by several ranks (largest first, then by key) their least loaded holder, counting
    the bytes of the shared tensors assigned so far (ties: lowest rank).

    Every rank computes the same answer from the same holdings. Keys held by one rank do not
    count towards the loads, so the choice among the holders of a shared key depends only on the
    shared keys: it is the same whether the ranks' other keys are known or not (a Checkpointer
    whose ranks spread their shared keys, :func:`spread`, picks what this picks).
    """
    writers: dict[str, int] = {}
    tensors: list[tuple[int, str]] = []
    for key, held in holdings.items():
        if not held:
            continue
        nbytes = max(held.values())
        if len(held) == 1 or nbytes == VALUE:
            writers[key] = min(held)
        else:
            tensors.append((nbytes, key))
    loads: dict[int, int] = {}
    for nbytes, key in sorted(tensors, key=lambda e: (-e[0], e[1])):
        rank = min(holdings[key], key=lambda r: (loads.get(r, 0), r))
        writers[key] = rank
        loads[rank] = loads.get(rank, 0) + nbytes
    return writers


def spread(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """:func:`assign_writers` when every one of ``world_size`` ranks holds every key of ``sizes``
    (key -> tensor bytes or VALUE); a heap instead of a scan over the ranks per key."""
    writers = {key: 0 for key, nbytes in sizes.items() if nbytes == VALUE}
    heap = [(0, r) for r in range(max(1, world_size))]
    for key, nbytes in sorted(((k, n) for k, n in sizes.items() if n != VALUE), key=lambda e: (-e[1], e[0])):
        load, rank = heapq.heappop(heap)
        writers[key] = rank
        heapq.heappush(heap, (load + nbytes, rank))
    return writers


def plain_sizes(split: SplitStateDict) -> dict[str, int]:
    """Each plain item of a DCP-style split: key -> its tensor's bytes, or VALUE."""
    from ..mapping import ByteItem

    out: dict[str, int] = {}
    for key, item in split.dcp_plain.items():
        if isinstance(item, ByteItem):
            out[key] = VALUE
        else:
            out[key] = _nbytes(item)
    return out


def _nbytes(sh: ShardedTensor) -> int:
    n = sh.dtype.itemsize
    for s in sh.global_shape:
        n *= s
    return n


def plain_digest(split: SplitStateDict) -> str:
    """A digest of the rank's plain keys with each tensor's dtype and shape ("" for a
    Megatron-style state dict, which has none): equal digests on every rank mean every rank holds
    the same plain items, so :func:`spread` is the global assignment. (msgpack, not pickle: its
    bytes depend only on the values, never on which objects are shared; ~2 us per key.)"""
    from ..mapping import ShardedTensor
    from .split import Dialect

    if split.dialect is not Dialect.DCP:
        return ""
    names: dict[torch.dtype, str] = {}
    rows: list[tuple[str, str, tuple[int, ...]]] = []
    for key, item in split.dcp_plain.items():
        if isinstance(item, ShardedTensor):
            name = names.get(item.dtype) or names.setdefault(item.dtype, _dtype(item.dtype))
            rows.append((key, name, item.global_shape))
        else:
            rows.append((key, "", ()))
    rows.sort()
    return hashlib.blake2b(msgpack.packb(rows), digest_size=16).hexdigest()


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class PlainWriters:
    """What a Checkpointer knows about the other ranks' plain items, across its saves.

    Order of calls per save: :meth:`skip` (the keys this rank holds but leaves to another rank:
    none until confirmed), :meth:`sent` once the SAVE is taken, then :meth:`committed` with the
    verdict's digest or :meth:`failed`. Saves are numbered as they are sent, so a late verdict
    of an older save never confirms past a newer failure. Not thread-safe (a Checkpointer is
    used from one thread).
    """

    confirmed: str = ""  # the digest a verdict confirmed every rank to send ("" for none)
    _sent: dict[int, tuple[int, str]] = field(default_factory=dict, repr=False)  # step -> (number, digest)
    _count: int = field(default=0, repr=False)  # saves sent
    _failed_after: int = field(default=-1, repr=False)  # number of the newest failed save
    _cached: tuple[str, int, int, frozenset[str]] | None = field(default=None, repr=False)

    def skip(self, digest: str, split: SplitStateDict, rank: int, world_size: int) -> frozenset[str]:
        """Plain keys of ``split`` that another rank writes: none unless ``digest`` is the
        confirmed one (then :func:`spread`'s assignment, computed once per confirmed digest)."""
        known = self.known_skip(digest, rank, world_size)
        if known is not None:
            return known
        writers = spread(plain_sizes(split), world_size)
        keys = frozenset(k for k, r in writers.items() if r != rank)
        self._cached = (digest, rank, world_size, keys)
        return keys

    def known_skip(self, digest: str, rank: int, world_size: int) -> frozenset[str] | None:
        """What :meth:`skip` returns for ``digest`` without a split, or None when it needs one
        (a confirmed digest whose assignment is not computed yet)."""
        if not digest or digest != self.confirmed:
            return frozenset()
        cached = self._cached
        if cached is not None and cached[:3] == (digest, rank, world_size):
            return cached[3]
        return None

    def sent(self, step: int, digest: str) -> None:
        """The save of ``step`` went out with plain-key digest ``digest``."""
        self._count += 1
        self._sent[step] = (self._count, digest)

    def committed(self, step: int, uniform: str) -> None:
        """The save of ``step`` committed; ``uniform`` is the verdict's digest (the one every
        rank sent, "" when they differed)."""
        number, digest = self._sent.pop(step, (0, ""))
        if number > self._failed_after:
            self.confirmed = uniform if uniform and uniform == digest else ""

    def failed(self, step: int) -> None:
        """The save of ``step`` failed (perhaps because another rank's keys changed): write every
        copy again until a newer save's verdict confirms the keys."""
        number, _ = self._sent.pop(step, (self._count, ""))
        self.confirmed = ""
        self._failed_after = max(self._failed_after, number)
