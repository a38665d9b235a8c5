"""torch_dist interop, both directions, on two real ranks (gloo, CPU), bit-exact.

1. ckptd writes (world size 2); torch DCP (DTensors on a CPU DeviceMesh), Megatron-Core and ckptd
   read it back at world size 2 with another sharding; ckptd and DCP also at world size 1.
2. torch DCP and Megatron-Core write (world size 2); ckptd reads both at world sizes 2 and 1.

The layouts are in tests/interop/reference.py. One multi-rank run per direction (each spawned
process costs seconds of imports); the ranks return lists of mismatches, asserted empty here.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd.format.dcp_metadata import read_index
from tests.interop.reference import (
    CFG_OBJECT,
    WORLD,
    assert_compact,
    check_loaded,
    check_single_rank,
    ckptd_load_request,
    ckptd_save_state,
    common_state,
    reference,
    rng_object,
    same_bits,
    same_object,
    save_slices,
    single_rank_request,
)
from tests.megatron_rank import megatron_save_on_cpu
from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# DTensor placements of the reference layouts: (axis of Shard at save, axis of Shard at load);
# None = a plain (whole, replicated) tensor.
DCP_SAVE_AXIS = {"dense.f32": 0, "dense.bf16": 1, "stack.f16": 0, "ids.i64": 0, "mask.bool": None}
DCP_LOAD_AXIS = {"dense.f32": 1, "dense.bf16": 0, "stack.f16": 2, "ids.i64": None, "mask.bool": None}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


def _dtensor(full: torch.Tensor, mesh: Any, axis: int | None, rank: int) -> Any:
    from torch.distributed.tensor import DTensor, Shard

    if axis is None:
        return full.clone()
    local = full.chunk(WORLD, axis)[rank].clone()
    return DTensor.from_local(local, mesh, [Shard(axis)], run_check=False)


# ---------------------------------------------------------------------------------------------
# Direction 1: ckptd writes, DCP / Megatron-Core / ckptd read.


def _ckptd_writes_others_read(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing as mdc

    path = os.path.join(root, "ckptd")
    ckptd.save(ckptd_save_state(rank, ckptd), path)
    bad: list[str] = []

    # torch DCP, DTensors resharded along other axes; objects as DCP byte items.
    mesh, full = _mesh(), reference()
    request = {k: _dtensor(full[k], mesh, DCP_LOAD_AXIS[k], rank) for k in full}
    request[f"rng/shard_{rank}_{WORLD}"] = io.BytesIO()
    request["cfg/shard_0_1"] = io.BytesIO()
    dcp.load(request, checkpoint_id=path)
    for k, axis in DCP_LOAD_AXIS.items():
        got = request[k].to_local() if axis is not None else request[k]
        expect = full[k] if axis is None else full[k].chunk(WORLD, axis)[rank]
        if not same_bits(got, expect):
            bad.append(f"dcp rank {rank}: tensor {k}")
    if not same_object([rng_object(rank)], request[f"rng/shard_{rank}_{WORLD}"]):
        bad.append(f"dcp rank {rank}: rng = {request[f'rng/shard_{rank}_{WORLD}']!r}")
    if not same_object([CFG_OBJECT], request["cfg/shard_0_1"]):
        bad.append(f"dcp rank {rank}: cfg")

    # Megatron-Core and ckptd, with the load layout of reference.py (common state included).
    bad += [f"megatron {m}" for m in check_loaded(rank, mdc.load(ckptd_load_request(rank, mdc), path))]
    bad += [f"ckptd {m}" for m in check_loaded(rank, ckptd.load(ckptd_load_request(rank, ckptd), path))]
    dist.barrier()
    return bad


def _stored_chunks(path: Path, key: str) -> int:
    return len(read_index(path).tensors[key].chunks)


@pytest.mark.timeout(150)
def test_ckptd_checkpoint_loads_in_dcp_and_megatron(tmp_path: Path):
    results = run_ranks(_ckptd_writes_others_read, WORLD, str(tmp_path), timeout_s=120)
    assert results == [[], []]
    path = tmp_path / "ckptd"
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "common.pt",
        "metadata.json",
    ]

    # World size 1, another split than at save: ckptd and torch DCP (plain whole tensors).
    assert check_single_rank(ckptd.load(single_rank_request(ckptd), path)) == []
    import torch.distributed.checkpoint as dcp

    full = {k: torch.empty_like(v) for k, v in reference().items()}
    full.update({f"rng/shard_{r}_{WORLD}": io.BytesIO() for r in range(WORLD)})
    full["cfg/shard_0_1"] = io.BytesIO()
    dcp.load(full, checkpoint_id=str(path), no_dist=True)
    assert all(same_bits(full[k], v) for k, v in reference().items())
    assert all(same_object([rng_object(r)], full[f"rng/shard_{r}_{WORLD}"]) for r in range(WORLD))
    assert same_object([CFG_OBJECT], full["cfg/shard_0_1"])

    # Replicas (mask.bool, cfg) are stored once; the size is the tensors plus small headers.
    assert _stored_chunks(path, "mask.bool") == 1 and _stored_chunks(path, "dense.f32") == 2
    assert len(read_index(path).objects) == WORLD + 1
    assert_compact(path, sum(t.numel() * t.element_size() for t in reference().values()))


# ---------------------------------------------------------------------------------------------
# Direction 2: DCP and Megatron-Core write, ckptd reads.


def _others_write_ckptd_reads(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing as mdc
    from torch.distributed.checkpoint import DefaultSavePlanner

    dcp_dir, mcore_dir = os.path.join(root, "dcp"), os.path.join(root, "megatron")
    mesh, full = _mesh(), reference()
    state: dict[str, Any] = {k: _dtensor(full[k], mesh, DCP_SAVE_AXIS[k], rank) for k in full}
    # ShardedObjects in Megatron-Core's encoding (torch.save([obj]) under the unique key); "cfg"
    # is on both ranks and written once. Not flattening keeps DCP from splitting the lists, and
    # stores each common value as one byte item.
    state[f"rng/shard_{rank}_{WORLD}"] = [rng_object(rank)]
    state["cfg/shard_0_1"] = [CFG_OBJECT]
    state.update(common_state())
    dcp.save(state, checkpoint_id=dcp_dir, planner=DefaultSavePlanner(flatten_state_dict=False))

    megatron_save_on_cpu()
    if rank == 0:
        os.makedirs(mcore_dir)
    dist.barrier()
    mdc.save(ckptd_save_state(rank, mdc), mcore_dir)
    dist.barrier()
    bad = []
    for name, path in (("dcp", dcp_dir), ("megatron", mcore_dir)):
        bad += [f"{name} {m}" for m in check_loaded(rank, ckptd.load(ckptd_load_request(rank, ckptd), path))]
    return bad


@pytest.mark.timeout(150)
def test_dcp_and_megatron_checkpoints_load_in_ckptd(tmp_path: Path):
    results = run_ranks(_others_write_ckptd_reads, WORLD, str(tmp_path), timeout_s=120, daemon=False)
    assert results == [[], []]
    for name in ("dcp", "megatron"):
        path = tmp_path / name
        assert check_single_rank(ckptd.load(single_rank_request(ckptd), path)) == [], name
        assert _stored_chunks(path, "mask.bool") == 1, name
        assert ckptd.load_common_state_dict(path) == common_state(), name
        plain = ckptd.load_plain_tensors(path)
        assert all(same_bits(plain[k], v) for k, v in reference().items()), name
    # The world-size-2 layouts of the two writers index identically for ckptd.
    dcp_index, mcore_index = read_index(tmp_path / "dcp"), read_index(tmp_path / "megatron")
    for key in save_slices(0):
        assert [c.sizes for c in dcp_index.tensors[key].chunks] == [c.sizes for c in mcore_index.tensors[key].chunks]
    assert set(dcp_index.objects) == set(mcore_index.objects) | set(common_state())
