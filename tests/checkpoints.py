"""Building real checkpoints (and roots of them) for the verify / CLI tests, in one process.

A "two-rank" checkpoint is written the way ``ckptd.save`` writes one on two ranks: each rank's
items go into its own ``__<rank>_0.distcp``, then ``common.pt``, ``.metadata`` and
``metadata.json`` are written (``ckptd.format.finalize.write_checkpoint``). Only the process group
is left out.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import torch

from ckptd.format.finalize import write_checkpoint
from ckptd.format.items import PlannedItem, plan_object, plan_tensor_items
from ckptd.format.layout import data_file_name
from ckptd.format.rootlayout import (
    TMP_SUFFIX,
    TRACKER_FILE,
    step_dir_name,
    tracker_bytes,
)
from ckptd.mapping import ShardedObject, ShardedTensor

WORLD = 2


def reference_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(8, 6, generator=g),
        "layer.bias": torch.randn(6, generator=g),
        "embedding": torch.randn(4, 4, generator=g).to(torch.bfloat16),
    }


def make_checkpoint(directory: str | os.PathLike, *, checksums: bool = True, step: int = 7) -> dict[str, torch.Tensor]:
    """Write a two-rank checkpoint into ``directory``; returns the full reference tensors.

    ``layer.weight`` is split by rows across the ranks (two chunks, two files), ``layer.bias`` and
    ``embedding`` are stored by rank 0 / rank 1, and each rank stores one ShardedObject shard.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ref = reference_tensors()

    def items(rank: int) -> list[PlannedItem]:
        rows = ref["layer.weight"].shape[0] // WORLD
        shards = [
            ShardedTensor.from_rank_offsets(
                "layer.weight", ref["layer.weight"][rank * rows : (rank + 1) * rows], (0, rank, WORLD)
            )
        ]
        if rank == 0:
            shards.append(ShardedTensor.from_rank_offsets("layer.bias", ref["layer.bias"]))
        else:
            shards.append(ShardedTensor.from_rank_offsets("embedding", ref["embedding"]))
        planned = [i for sh in shards for i in plan_tensor_items(sh, rank)]
        return planned + [
            plan_object(ShardedObject("rng", {"rank": rank, "seed": 1234 + rank}, (WORLD,), (rank,)), rank)
        ]

    write_checkpoint(
        directory, map(items, range(WORLD)), {"iteration": step, "note": "test"}, fsync=False, checksums=checksums
    )
    return ref


def make_root(root: str | os.PathLike, steps: list[int], latest: int | None) -> Path:
    """A Checkpointer-style root with committed ``iter_<step>`` checkpoints and a tracker."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for step in steps:
        make_checkpoint(root / step_dir_name(step), step=step)
    if latest is not None:
        (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(latest)))
    return root


def make_partial(root: Path, step: int, age_s: float) -> Path:
    """An ``iter_<step>.tmp`` directory (an abandoned save) whose files were last written ``age_s`` ago.

    That is how older ckptd versions named a partial save; today's name has the attempt between
    step and suffix (``ckptd.format.rootlayout.tmp_dir_name``), and both are partial saves alike."""
    path = root / (step_dir_name(step) + TMP_SUFFIX)
    path.mkdir()
    (path / data_file_name(0)).write_bytes(b"\0" * 4096)
    when = os.path.getmtime(path) - age_s
    for p in (path / data_file_name(0), path):
        os.utime(p, (when, when))
    return path


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def stamp_commits(root: str | os.PathLike, steps_in_commit_order: list[int]) -> None:
    """Give ``root``'s ``iter_<step>`` checkpoints commit records, committed in the given order
    (as the coordinator does: ckptd.format.commitrecord)."""
    from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord

    for seq, step in enumerate(steps_in_commit_order, start=1):
        rec = CommitRecord(seq=seq, step=step, attempt="0123456789ab-1", committed_unix_s=1.0e9 + seq)
        (Path(root) / step_dir_name(step) / COMMIT_RECORD).write_bytes(rec.to_bytes())


# The class a newer writer's .metadata could name: a Metadata subclass under a module ckptd never saw.
FUTURE_MODULE, FUTURE_CLASS = "future_writer.checkpoint", "MetadataV9"


@contextlib.contextmanager
def future_writer_importable() -> Iterator[type]:
    """While inside: ``future_writer.checkpoint.MetadataV9`` (a subclass of DCP's Metadata) can be
    imported, as where the writer that pickles it is installed."""
    from torch.distributed.checkpoint.metadata import Metadata

    cls = type(FUTURE_CLASS, (Metadata,), {"__module__": FUTURE_MODULE})
    package, module = types.ModuleType("future_writer"), types.ModuleType(FUTURE_MODULE)
    setattr(module, FUTURE_CLASS, cls)
    saved = {name: sys.modules.get(name) for name in ("future_writer", FUTURE_MODULE)}
    sys.modules.update({"future_writer": package, FUTURE_MODULE: module})
    try:
        yield cls
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def rewrite_as_future_class(directory: str | os.PathLike) -> None:
    """Rewrite ``directory``'s ``.metadata`` as a newer writer would: the same object, pickled as
    :data:`FUTURE_CLASS` of :data:`FUTURE_MODULE`, a module this process cannot import."""
    path = Path(directory) / ".metadata"
    md = pickle.loads(path.read_bytes())
    with future_writer_importable() as cls:
        renamed = cls.__new__(cls)
        renamed.__dict__.update(vars(md))
        path.write_bytes(pickle.dumps(renamed))
