"""Executing a read plan: each stored chunk is read once, in file order, and fanned out."""

from __future__ import annotations

import os

from ..errors import CorruptCheckpointError
from ..format.reader import DataFiles, load_tensor_bytes
from .plan import ReadPlan


def execute(plan: ReadPlan, directory: str | os.PathLike) -> None:
    with DataFiles(directory) as files:
        for (rel, offset), (chunk, what, copies) in sorted(plan.reads.items()):
            data = files.read(rel, offset, chunk.length, what)
            source = load_tensor_bytes(data, what, rel)
            del data
            if tuple(source.shape) != tuple(chunk.sizes) or source.dtype != copies[0].target.dtype:
                raise CorruptCheckpointError(
                    f"{what} in {rel} is {source.dtype} {tuple(source.shape)} but the metadata "
                    f"says {copies[0].target.dtype} {chunk.sizes}; the checkpoint is damaged"
                )
            for c in copies:
                c.target[c.dst].copy_(source[c.src])
