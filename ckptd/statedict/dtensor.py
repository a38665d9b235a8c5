"""A DTensor as ckptd ShardedTensors: the boxes of the global tensor this rank holds.

torch DCP stores a DTensor's local shard as one chunk of the global tensor at the offset
``compute_local_shape_and_global_offset`` gives, under the DTensor's flattened key; ckptd does the
same, so either library loads what the other saved, into any mesh or world size.

- ``Shard(d)`` (also nested, e.g. ``[Shard(0), Shard(0)]``, and uneven: a rank may hold fewer
  rows or none): one box.
- ``Replicate()``: the box is the same on every rank along that mesh dimension; the rank at
  coordinate 0 there is the main replica and writes it, the others write nothing.
- ``_StridedShard`` (FSDP2 over a dimension another parallelism already shards): the local rows
  are not one contiguous range of the global tensor, so they are stored as one box per
  contiguous run of rows. (DCP records a single chunk at the first row here, which does not
  describe the data.)
- ``Partial()``: the local values are partial sums, not the tensor's values: refused.

The pieces' ``data`` are views of the local tensor, so a load fills the DTensor in place.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ShardingError
from ..mapping import ShardedTensor


def dtensor_pieces(key: str, dt: Any, where: str) -> list[ShardedTensor]:
    """The ShardedTensors that store this rank's part of DTensor ``dt`` under ``key``.

    Empty boxes are left out (a tensor of no element is one empty piece, on the mesh's first
    rank); a rank outside ``dt``'s mesh holds nothing and gets ``[]``.
    Raises ShardingError (naming ``where``) for placements that cannot be stored as they are.
    """
    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    for dim, p in enumerate(placements):
        if p.is_partial():
            raise ShardingError(
                f"{where} is a DTensor with a Partial placement on mesh dimension {dim}: its local "
                "values are partial results, not the tensor's values. Reduce it first "
                "(dt.redistribute(placements=[Replicate(), ...]) or dt.full_tensor())"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    local = dt.to_local()
    if type(local) is not torch.Tensor:
        raise ShardingError(
            f"{where} is a DTensor whose local tensor is a {type(local).__name__}, not a plain "
            "torch.Tensor; ckptd stores only plain local tensors (wait for pending collectives, "
            "or convert the local tensor first)"
        )
    gshape = tuple(dt.shape)
    runs = _runs_per_dim(gshape, mesh, placements, coordinate, where)
    if tuple(sum(n for _, _, n in r) for r in runs) != tuple(local.shape):
        raise ShardingError(
            f"{where} is a DTensor whose local tensor has shape {tuple(local.shape)}, but its "
            f"placements {placements} on mesh {tuple(mesh.shape)} give this rank "
            f"{tuple(sum(n for _, _, n in r) for r in runs)} (a padded local tensor?)"
        )
    replica = tuple(c for c, p in zip(coordinate, placements) if p.is_replicate())
    if math.prod(gshape) == 0:
        # No element: every box is empty, and leaving them all out dropped the key from the
        # checkpoint. One empty piece of the whole shape, from the mesh's first rank, stores it.
        if any(coordinate):
            return []
        empty = local.new_empty(gshape)
        return [ShardedTensor(key, empty, local.dtype, gshape, gshape, (0,) * len(gshape), axis_fragmentations=None)]
    pieces = []
    for box in _product(runs):
        sizes = tuple(n for _, _, n in box)
        if 0 in sizes:
            continue
        view = local[tuple(slice(lo, lo + n) for lo, _, n in box)]
        pieces.append(
            ShardedTensor(
                key,
                view,
                local.dtype,
                sizes,
                gshape,
                tuple(g for _, g, _ in box),
                axis_fragmentations=None,
                replica_id=replica or 0,
            )
        )
    return pieces


# Per tensor dimension: contiguous runs as (local start, global start, length).
_Runs = list[tuple[int, int, int]]


def _runs_per_dim(
    gshape: tuple[int, ...], mesh: Any, placements: tuple, coordinate: list[int], where: str
) -> list[_Runs]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Shard

    if all(type(p) is Shard or p.is_replicate() for p in placements):
        sizes, offsets = compute_local_shape_and_global_offset(gshape, mesh, placements)
        return [[(0, o, n)] for o, n in zip(offsets, sizes)]
    indices = _global_indices(gshape, mesh, placements, coordinate, where)
    return [_contiguous_runs(indices.get(d), n) for d, n in enumerate(gshape)]


def _global_indices(
    gshape: tuple[int, ...], mesh: Any, placements: tuple, coordinate: list[int], where: str
) -> dict[int, list[int]]:
    """For each sharded tensor dimension, the global index of each local row, in local order."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
        from torch.distributed.tensor.placement_types import Shard, _StridedShard
    except ImportError as exc:
        raise ShardingError(
            f"{where} is a DTensor with placements {placements}, which this torch "
            f"version does not let ckptd resolve ({exc})"
        ) from exc
    local = list(gshape)
    offsets: dict[int, Any] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, _StridedShard)):
            if not p.is_replicate():
                raise ShardingError(f"{where} is a DTensor with placement {p!r}, which ckptd cannot store")
            continue
        size, index = _get_shard_size_and_offsets(
            local[p.dim],
            mesh.shape[mesh_dim],
            coordinate[mesh_dim],
            p,
            offsets.get(p.dim),
            gshape[p.dim],
            False,
        )
        local[p.dim] = int(size)
        offsets[p.dim] = index
    return {d: [int(i) for i in idx.tolist()][: local[d]] for d, idx in offsets.items()}


def _contiguous_runs(indices: list[int] | None, full: int) -> _Runs:
    if indices is None:
        return [(0, 0, full)]
    runs: _Runs = []
    for pos, g in enumerate(indices):
        if runs and runs[-1][1] + runs[-1][2] == g:
            lo, start, n = runs[-1]
            runs[-1] = (lo, start, n + 1)
        else:
            runs.append((pos, g, 1))
    return runs or [(0, 0, 0)]


def _product(runs: list[_Runs]) -> list[tuple[tuple[int, int, int], ...]]:
    boxes: list[tuple[tuple[int, int, int], ...]] = [()]
    for dim_runs in runs:
        boxes = [b + (r,) for b in boxes for r in dim_runs]
    return boxes
