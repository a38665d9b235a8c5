"""Tensors of any dtype as random bytes, compared bit for bit (NaNs and all special patterns), and
the dtypes torch DCP can save."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ALL_DTYPES: list[torch.dtype] = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def dtype_label(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the canonical name ckptd records."""
    return str(dtype).removeprefix("torch.")


def random_tensor(dtype: torch.dtype, seed: int, shape: tuple[int, ...] = (6, 10)) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (bool: 0/1, the only bytes a bool may hold)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (``torch.equal`` is not implemented for every dtype, and NaN != NaN)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def dcp_round_trips(dtype: torch.dtype, directory: Path) -> bool:
    """Whether torch DCP (single process) saves and loads a tensor of ``dtype`` bit-exact."""
    t = random_tensor(dtype, 0, (2, 3))
    try:
        dcp.save({"t": t}, checkpoint_id=str(directory), no_dist=True)
        out = {"t": torch.zeros(2, 3 * dtype.itemsize, dtype=torch.uint8).view(dtype)}
        dcp.load(out, checkpoint_id=str(directory), no_dist=True)
    except BaseException:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return False
    return same_bits(out["t"], t)


def dcp_dtypes(scratch: Path) -> list[torch.dtype]:
    """Every ``torch.<name>`` dtype torch DCP round-trips, found by trying each (under ``scratch``)."""
    return [dt for dt in ALL_DTYPES if dcp_round_trips(dt, scratch / dtype_label(dt))]
