"""Parallel layouts for resharding tests: N-D TP shards and flattened distributed-optimizer shards.

A layout is ``(TP, DP)``; rank ``r`` is ``(tp, dp) = (r % TP, r // TP)``. Model tensors are split
over TP along their ``axis`` (near-equal parts, so any TP works, uneven included) and replicated
over DP. Optimizer state is sharded like a distributed optimizer: each TP rank's local chunks of
all tensors are concatenated into one flat buffer, which is split into DP near-equal ranges; a
tensor's flat shard on a DP rank is its part of that rank's range (possibly empty, skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ckptd import ShardedTensor

# key -> (shape, dtype, TP split axis or None for replicated)
MODEL = {
    "embed.weight": ((22, 6), torch.float32, 0),
    "layer.qkv.weight": ((18, 6), torch.float32, 0),
    "layer.qkv.bias": ((18,), torch.bfloat16, 0),
    "layer.proj.weight": ((6, 14), torch.float32, 1),
    "layer.norm.weight": ((6,), torch.float32, None),
    "layer.conv.weight": ((5, 12, 7), torch.float32, 1),
    "layer.int_table": ((9, 4), torch.int64, 0),
}


def reference(key: str) -> torch.Tensor:
    """The full tensor of ``key``: deterministic in every process."""
    shape, dtype, _ = MODEL[key]
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    t = torch.randn(shape, generator=g) * 100
    return t.to(dtype)


def optim_reference(key: str) -> torch.Tensor:
    shape, _, _ = MODEL[key]
    g = torch.Generator().manual_seed(1000 + sum(map(ord, key)))
    return torch.randn(shape, generator=g)


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(start, size)`` of part ``i`` of ``n`` split into ``parts`` near-equal parts."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (1 if i < extra else 0)


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def name(self) -> str:
        return f"tp{self.tp}dp{self.dp}"

    def coords(self, rank: int) -> tuple[int, int]:
        return rank % self.tp, rank // self.tp

    def chunk(self, key: str, tp_rank: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes, axis_fragmentations)`` of the TP chunk of ``key``."""
        shape, _, axis = MODEL[key]
        offs, sizes, frags = [0] * len(shape), list(shape), [1] * len(shape)
        if axis is not None:
            offs[axis], sizes[axis] = split(shape[axis], self.tp, tp_rank)
            frags[axis] = self.tp
        return tuple(offs), tuple(sizes), tuple(frags)

    def model_shard(self, key: str, rank: int, full: torch.Tensor | None) -> ShardedTensor:
        """N-D shard; ``full`` given: data sliced from it, else an empty (NaN/garbage) buffer."""
        shape, dtype, axis = MODEL[key]
        tp, dp = self.coords(rank)
        offs, sizes, frags = self.chunk(key, tp)
        if full is not None:
            data = full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].clone()
        else:
            data = torch.full(sizes, 7, dtype=dtype)
        replica = dp if axis is not None else rank  # replicated tensors: rank 0 writes them
        return ShardedTensor(key, data, dtype, sizes, shape, offs, frags, replica)

    def flat_ranges(self, keys: list[str], rank: int) -> dict[str, tuple[int, int]]:
        """Distributed-optimizer ranges (within each key's flattened TP chunk) of ``rank``."""
        tp, dp = self.coords(rank)
        numels = [math.prod(self.chunk(k, tp)[1]) for k in keys]
        start, size = split(sum(numels), self.dp, dp)
        out, base = {}, 0
        for k, n in zip(keys, numels):
            lo, hi = max(start, base), min(start + size, base + n)
            if lo < hi:
                out[k] = (lo - base, hi - base)
            base += n
        return out

    def flat_shard(
        self, key: str, ckpt_key: str, rank: int, fr: tuple[int, int], dtype: torch.dtype, full: torch.Tensor | None
    ) -> ShardedTensor:
        tp, _ = self.coords(rank)
        offs, sizes, frags = self.chunk(key, tp)
        if full is not None:
            chunk = full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
            data = chunk.reshape(-1)[fr[0] : fr[1]].clone()
        else:
            data = torch.full((fr[1] - fr[0],), 7, dtype=dtype)
        replica = tp if MODEL[key][2] is None else 0  # TP-replicated: TP rank 0 writes it
        return ShardedTensor(
            ckpt_key, data, dtype, sizes, MODEL[key][0], offs, frags, replica, flattened_range=slice(*fr)
        )


def expected_nd(full: torch.Tensor, sh: ShardedTensor) -> torch.Tensor:
    box = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.chunk_shape()))
    return full[box].reshape(sh.local_shape)


def expected_flat(full: torch.Tensor, sh: ShardedTensor) -> torch.Tensor:
    box = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.chunk_shape()))
    fr = sh.flattened_range
    return full[box].reshape(-1)[fr.start : fr.stop]
