"""Crafted chunk lists in a real checkpoint's ``.metadata``: what they can make a load cost.

- The overlap check every load runs on every stored tensor (requested or not) stays near
  n log n on a chunk list laid out to make its sweep compare every pair: a load of another key
  took 22 s with 8,000 such chunks (1 MB) and would take about 35 minutes with 100,000 (10 MB).
- A list so irregular (on several axes at once) that checking it would take longer than reading
  it is refused as a CorruptCheckpointError; ``ckptd verify`` names its tensor.
- Items that overlap in a data file hold their shared bytes once: 2,000 items at offsets 0, 1,
  2, ... of one 256 KiB file do not let a load allocate 512 MiB for them.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import ckptd
from ckptd import CorruptCheckpointError, ShardedTensor
from ckptd.mapping import ShardedTensor as _ShardedTensor
from ckptd.verify import verify_checkpoint

X = torch.arange(64 * 1024, dtype=torch.float32)  # a data file of about 256 KiB


def _genuine(directory: Path) -> Path:
    ckptd.save({"x": ShardedTensor.from_rank_offsets("x", X.clone())}, directory)
    return directory


def _add_tensor(
    directory: Path,
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]],
    where: Callable[[int, str, int], tuple[int, int]],
) -> None:
    """Add tensor ``key`` to ``.metadata``: ``chunks`` of (offsets, sizes), chunk ``i`` stored at
    ``where(i, data_file, data_file_size)`` = (offset, length) in the checkpoint's data file."""
    md: Any = pickle.loads((directory / ".metadata").read_bytes())
    rel = next(v.relative_path for k, v in md.storage_data.items() if k.fqn == "x")
    size = (directory / rel).stat().st_size
    metas = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks]
    md.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), metas)
    for i, c in enumerate(metas):
        md.storage_data[MetadataIndex(key, c.offsets)] = _StorageInfo(rel, *where(i, rel, size))
    (directory / ".metadata").write_bytes(pickle.dumps(md))


def _load_x(directory: Path) -> torch.Tensor:
    out = ckptd.load({"x": ShardedTensor.from_rank_offsets("x", torch.zeros_like(X))}, directory)
    return out["x"]


@pytest.mark.timeout(120)  # before: about 140 s for the check alone, on every load
def test_a_chunk_list_crafted_against_the_sweep_does_not_stall_a_load(tmp_path):
    ckpt = _genuine(tmp_path / "c")
    n = 20_000
    # The review's staircase: columns starting one further on both axes, below one wide row.
    chunks = [((i, i), (n - i, 1)) for i in range(n)] + [((n, 0), (1, n))]
    _add_tensor(ckpt, "evil", torch.uint8, (n + 1, n), chunks, lambda i, rel, size: (0, 10**9))
    assert torch.equal(_load_x(ckpt), X)
    report = verify_checkpoint(ckpt)  # runs the same check, as a commit does
    assert report.status == "DAMAGED"
    assert any(e.item == "evil" and "cover" in e.message for e in report.errors), report.errors


def _irregular(n: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``n`` chunks of a 4-D tensor, none overlapping: each one element thick on one axis and
    reaching the far end from a random start on the other three, so no axis is a grid's."""
    rng = random.Random(4)
    far = 10 * n
    out = []
    for i in range(n):
        starts = tuple(i // 4 if ax == i % 4 else rng.randrange(n, far - 1) for ax in range(4))
        out.append((starts, tuple(1 if ax == i % 4 else far - s for ax, s in enumerate(starts))))
    return out


def test_a_chunk_list_too_irregular_to_check_is_refused(tmp_path):
    ckpt = _genuine(tmp_path / "c")
    n = 4000
    _add_tensor(ckpt, "evil", torch.uint8, (10 * n,) * 4, _irregular(n), lambda i, rel, size: (0, 10**15))
    with pytest.raises(CorruptCheckpointError, match=r"4000 chunks .* the check was stopped.*ckptd verify"):
        _load_x(ckpt)  # before: loaded after a 2 s check (40,000 such chunks: 3 minutes)
    report = verify_checkpoint(ckpt)
    assert report.status == "DAMAGED"
    assert any(e.item == "evil" and "vary on several axes" in e.message for e in report.errors), report.errors


@pytest.fixture
def no_large_allocation(monkeypatch):
    """Fails a test, instead of allocating, when a load allocates more than 1 MiB for a template."""
    real = _ShardedTensor.init_data

    def init_data(self: _ShardedTensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        numel = 1
        for n in self.local_shape:
            numel *= n
        assert numel * self.dtype.itemsize <= 1 << 20, f"allocated {numel * self.dtype.itemsize} bytes for {self.key}"
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_ShardedTensor, "init_data", init_data)


@pytest.mark.usefixtures("no_large_allocation")
def test_items_that_overlap_in_a_file_hold_their_bytes_once(tmp_path):
    ckpt = _genuine(tmp_path / "c")
    size = next(p for p in ckpt.iterdir() if p.suffix == ".distcp").stat().st_size
    n, row = 2000, (size - 2000) // 4
    # Chunk i: row i, its item at byte i of the one data file and reaching its end: each item
    # holds a row's bytes, but all of them together only the file's 256 KiB, not 2000 rows' 512 MiB.
    chunks = [((i, 0), (1, row)) for i in range(n)]
    _add_tensor(ckpt, "big", torch.float32, (n, row), chunks, lambda i, rel, size: (i, size - i))
    hold = rf"tensor 'big'.*\(this request: {n * row * 4} bytes\).*hold {size} bytes.*Nothing was allocated"
    with pytest.raises(CorruptCheckpointError, match=hold):
        ckptd.load_plain_tensors(ckpt)  # before: allocated 512 MiB, then failed reading row 0
    with pytest.raises(CorruptCheckpointError, match=hold):
        ckptd.load(ckptd.load_tensors_metadata(ckpt), ckpt)
    assert torch.equal(_load_x(ckpt), X)  # the genuine tensor still loads


@pytest.mark.usefixtures("no_large_allocation")
def test_tensors_whose_items_share_the_same_bytes_hold_them_once(tmp_path):
    """Each of 40 tensors stored at the bytes of the genuine one passes the check above on its own
    (its items hold its bytes), and load_plain_tensors kept every one: 40 times the data file's
    size from one file. The request's tensors together are bounded by the files they are in."""
    ckpt = _genuine(tmp_path / "c")
    md: Any = pickle.loads((ckpt / ".metadata").read_bytes())
    ((index, info),) = [(k, v) for k, v in md.storage_data.items() if k.fqn == "x"]
    for n in range(40):
        _add_tensor(
            ckpt,
            f"copy{n}",
            torch.float32,
            tuple(X.shape),
            [((0,), tuple(X.shape))],
            lambda *_: (info.offset, info.length),
        )
    with pytest.raises(
        CorruptCheckpointError, match=r"the \d+ tensors of this request .* need \d+ bytes, but the 1 data files"
    ):
        ckptd.load_plain_tensors(ckpt)
    assert torch.equal(_load_x(ckpt), X)
