"""What trainers hand ckptd, on real ranks (gloo, CPU): Megatron-Core's own mapping classes and
DTensor state dicts, saved synchronously and through the daemon, read back by Megatron-Core, torch
DCP and ckptd at other layouts and world sizes, bit-exact; and what must be refused on every rank.

Real models (a Megatron-Core GPTModel, an FSDP2 model with AdamW) are in tests/real/.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from tests.interop.reference import same_bits
from tests.megatron_rank import megatron_save_on_cpu
from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _async_env(runtime_dir: Path) -> dict[str, str]:
    return {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "2", "CKPTD_HEARTBEAT_S": "0.2"}


# ---------------------------------------------------------------------------------------------
# Megatron-Core's own classes


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed({"w": 1, "layers": 2, "qkv": 3, "a": 4}[name])
    return {
        "w": torch.randn(4, 6, generator=g),
        "layers": torch.randn(2, 3, 4, generator=g),
        "qkv": torch.randn(6, 4, generator=g),
        "a": torch.randn(5, generator=g),
    }[name]


def _mcore_state(rank: int, world: int, *, empty: bool = False) -> dict[str, Any]:
    """A state dict built only from Megatron-Core's classes, as its models and optimizers build
    them: TP-split and prepended-axis tensors, a factory (a fused qkv stored as q/k/v pieces),
    ShardedObjects, a local object, nested dicts and lists, and common state."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    def data(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t.clone()

    w = _full("w").chunk(world, 1)[rank]
    qkv = _full("qkv")

    def build(key, t, replica_id, flattened_range):
        return {
            name: ShardedTensor.from_rank_offsets(f"{key}.{name}", piece, replica_id=replica_id)
            for name, piece in zip("qkv", t.chunk(3, 0))
        }

    def merge(pieces):
        return torch.cat([pieces[name] for name in "qkv"], 0)

    return {
        "model": {
            "w": ShardedTensor.from_rank_offsets("w", data(w), (1, rank, world)),
            "layers": [
                ShardedTensor.from_rank_offsets(
                    "layers", data(_full("layers")[i]), (0, i, 2), replica_id=rank, prepend_axis_num=1
                )
                for i in range(2)
            ],
            "qkv": ShardedTensorFactory("attn.qkv", data(qkv), build, merge, replica_id=rank),
        },
        "rng": [ShardedObject("rng", None if empty else {"seed": rank}, (world,), (rank,))],
        "scratch": LocalNonpersistentObject(f"rank {rank}"),
        "iteration": 5,
        "args": {"lr": 0.1, "layers": [1, 2]},
    }


def _check_mcore(loaded: dict[str, Any], rank: int, world: int, where: str) -> list[str]:
    bad = []
    if not same_bits(loaded["model"]["w"], _full("w").chunk(world, 1)[rank]):
        bad.append(f"{where}: w")
    if not all(same_bits(loaded["model"]["layers"][i], _full("layers")[i]) for i in range(2)):
        bad.append(f"{where}: layers")
    if not same_bits(loaded["model"]["qkv"], _full("qkv")):
        bad.append(f"{where}: qkv")
    if loaded["rng"] != [{"seed": rank}] or loaded["iteration"] != 5 or loaded["args"] != {"lr": 0.1, "layers": [1, 2]}:
        bad.append(f"{where}: objects/common {loaded['rng']} {loaded['iteration']} {loaded['args']}")
    if loaded["scratch"] != f"rank {rank}":
        bad.append(f"{where}: local object {loaded['scratch']!r}")
    return bad


def _mcore_objects_round_trip(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc

    bad: list[str] = []
    sync_dir, mcore_dir = os.path.join(root, "sync"), os.path.join(root, "mcore")
    ckptd.save(_mcore_state(rank, world), sync_dir)
    with ckptd.Checkpointer(os.path.join(root, "async")) as ckpt:
        ckpt.save(_mcore_state(rank, world), step=1).wait(timeout_s=60)
        async_dir = str(ckpt.checkpoint_dir())
    megatron_save_on_cpu()
    if rank == 0:
        os.makedirs(mcore_dir)
    dist.barrier()
    mdc.save(_mcore_state(rank, world), mcore_dir)
    dist.barrier()
    for name, path in (("ckptd sync", sync_dir), ("ckptd async", async_dir), ("megatron", mcore_dir)):
        if not ckptd.load_tensors_metadata(path):
            bad.append(f"{name}: no tensors stored")
        request = _mcore_state(rank, world, empty=True)
        target = request["model"]["w"].data
        out = ckptd.load(request, path)
        bad += _check_mcore(out, rank, world, f"ckptd.load of {name}")
        if out["model"]["w"] is not target:
            bad.append(f"ckptd.load of {name}: not loaded in place")
        if name != "megatron":
            bad += _check_mcore(
                mdc.load(_mcore_state(rank, world, empty=True), path), rank, world, f"megatron load of {name}"
            )
    # A list whose entries are all sharded leaves no placeholder in common.pt that Megatron-Core's
    # load would trip over.
    path = os.path.join(root, "list")
    a = _full("a")
    ckptd.save({"layers": [ckptd.ShardedTensor.from_rank_offsets("layers.a", a.clone(), replica_id=rank)]}, path)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MST  # noqa: N814 - Megatron's class

    out = mdc.load({"layers": [MST.from_rank_offsets("layers.a", torch.empty(5), replica_id=rank)]}, path)
    if not same_bits(out["layers"][0], a):
        bad.append("megatron load of a list of ShardedTensors")
    dist.barrier()
    return bad


@pytest.mark.timeout(240)
def test_megatron_core_objects_round_trip(tmp_path: Path, runtime_dir: Path):
    results = run_ranks(
        _mcore_objects_round_trip, 2, str(tmp_path), timeout_s=220, daemon=False, env=_async_env(runtime_dir)
    )
    assert results == [[], []]


def _common_differs(rank: int, world: int, root: str) -> list[str]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("ckptd").addHandler(handler)
    w = ckptd.ShardedTensor.from_rank_offsets("w", torch.ones(2), (0, rank, world))
    ckptd.save({"w": w, "iteration": 5 + (rank == 1)}, os.path.join(root, "c"))
    logging.getLogger("ckptd").removeHandler(handler)
    return [m for m in records if "common state" in m]


@pytest.mark.timeout(120)
def test_common_state_that_differs_between_ranks_is_reported(tmp_path: Path):
    logs = run_ranks(_common_differs, 2, str(tmp_path), timeout_s=100)
    assert any("ranks [1] differs from rank 0's" in m for m in logs[0]), logs
    assert any("this rank's (1) common state differs" in m for m in logs[1]), logs
    assert ckptd.load_common_state_dict(tmp_path / "c") == {"iteration": 5}


# ---------------------------------------------------------------------------------------------
# DTensors


def _reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "a": torch.randn(10, 3, generator=g),  # Shard(0) over 4: 3,3,3,1 rows
        "b": torch.randn(6, 5, generator=g),  # 2x2 mesh (Shard(0), Shard(1)): columns 3,2
        "c": torch.randn(4, 4, generator=g).to(torch.bfloat16),  # 2x2 (Replicate(), Shard(0))
        "d": torch.arange(7, dtype=torch.int64),  # Replicate()
        "e": torch.randn(3, generator=g),  # a plain tensor, the same on every rank
        "f": torch.randn(2, 3, generator=g),  # Shard(1) over 4: 1,1,1,0 columns
        "g": torch.zeros(0, 4),  # no element: every box is empty (it was left out of the checkpoint)
        # On the 2x2 mesh's "tp" submesh: each data-parallel group's ranks hold the whole tensor,
        # so each chunk comes from two ranks (data-parallel replicas; it failed the save).
        "h": torch.randn(6, 2, generator=g),
        "i": torch.randn(5, generator=g),
    }


def _save_placements():
    from torch.distributed.tensor import Replicate, Shard

    return {
        "a": ("1d", [Shard(0)]),
        "b": ("2d", [Shard(0), Shard(1)]),
        "c": ("2d", [Replicate(), Shard(0)]),
        "d": ("1d", [Replicate()]),
        "f": ("1d", [Shard(1)]),
        "g": ("1d", [Shard(0)]),
        "h": ("tp", [Shard(0)]),
        "i": ("tp", [Replicate()]),
    }


def _dtensor_state(world: int, placements: dict, full: dict[str, torch.Tensor], *, zero: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        meshes["tp"] = meshes["2d"]["tp"]
    model = {}
    for k, (mesh, pl) in placements.items():
        t = torch.zeros_like(full[k]) if zero else full[k]
        model[k] = distribute_tensor(t, meshes[mesh], pl)
    model["e"] = torch.zeros_like(full["e"]) if zero else full["e"].clone()
    return {"model": model, "step": 0 if zero else 7, "opt": {"lr": 0.0 if zero else 0.1, "betas": [0.9, 0.95]}}


def _check_dtensor_state(sd: dict, full: dict[str, torch.Tensor], where: str) -> list[str]:
    from torch.distributed.tensor import DTensor

    bad = []
    for k, ref in full.items():
        got = sd["model"][k]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        if not same_bits(got, ref):
            bad.append(f"{where}: {k}")
    if sd["step"] != 7 or sd["opt"] != {"lr": 0.1, "betas": [0.9, 0.95]}:
        bad.append(f"{where}: values {sd['step']} {sd['opt']}")
    return bad


def _dtensors_save_at_4(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    full = _reference()
    ckptd.save(_dtensor_state(world, _save_placements(), full), os.path.join(root, "sync"))
    with ckptd.Checkpointer(os.path.join(root, "async")) as ckpt:
        ckpt.save(_dtensor_state(world, _save_placements(), full), step=3).wait(timeout_s=60)
    dcp.save(_dtensor_state(world, _save_placements(), full), checkpoint_id=os.path.join(root, "dcp"))
    bad = []
    # Same world size, another layout: every reader fills the DTensors in place.
    other = {
        "a": ("2d", [Shard(1), Shard(0)]),
        "b": ("1d", [Shard(0)]),
        "c": ("1d", [Shard(1)]),
        "d": ("2d", [Shard(0), Shard(0)]),
        "f": ("2d", [Shard(0), Shard(1)]),
        "g": ("2d", [Shard(1), Shard(0)]),
        "h": ("1d", [Shard(1)]),
        "i": ("tp", [Shard(0)]),
    }
    for name in ("sync", "async/iter_0000003", "dcp"):
        path = os.path.join(root, name)
        req = _dtensor_state(world, other, full, zero=True)

        def ptr(v):
            return (v.to_local() if hasattr(v, "to_local") else v).data_ptr()

        before = {k: (v, ptr(v)) for k, v in req["model"].items()}
        assert ckptd.load(req, path) is req
        bad += _check_dtensor_state(req, full, f"ckptd.load of {name}")
        if any(req["model"][k] is not v or ptr(v) != p for k, (v, p) in before.items()):
            bad.append(f"ckptd.load of {name}: not in place")
        if name != "dcp":
            req = _dtensor_state(world, other, full, zero=True)
            dcp.load(req, checkpoint_id=path)
            bad += _check_dtensor_state(req, full, f"dcp.load of {name}")
    # FSDP2 over a dimension that is already sharded uses _StridedShard: a rank's rows are not
    # one range of the global tensor (rank 0 holds rows 0 and 4 here), so they are stored as one
    # chunk per run of rows.
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.arange(24, dtype=torch.float32).reshape(8, 3)
    strided = distribute_tensor(g, mesh, [_StridedShard(0, split_factor=2)])
    ckptd.save({"g": strided}, os.path.join(root, "strided"))
    req = {"g": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])}
    ckptd.load(req, os.path.join(root, "strided"))
    if not same_bits(req["g"].full_tensor(), g):
        bad.append("_StridedShard round trip")
    # Refused on every rank, naming the key, before anything is written.
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    for sd, pattern in (
        ({"x": partial}, "'x' is a DTensor with a Partial placement"),
        ({"x": (1, distribute_tensor(torch.ones(4), mesh, [Shard(0)]))}, "sits inside a tuple"),
    ):
        try:
            ckptd.save(sd, os.path.join(root, "refused"))
            bad.append(f"saved {pattern}")
        except ckptd.ShardingError as exc:
            if pattern not in str(exc):
                bad.append(f"wrong error for {pattern}: {exc}")
    if os.path.exists(os.path.join(root, "refused")):
        bad.append("a refused save left files")
    # Two pipeline stages (the 2x2 mesh's "dp" groups standing in) whose layers are numbered from 0
    # on each: one key, different tensors. Copies of a chunk are kept once only when equal.
    # Replicated on the "tp" submesh, a chunk is the whole tensor, as a plain tensor's record is:
    # such copies were kept from one rank (a warning in the handle, none from ckptd.save).
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = mesh2d.get_coordinate()[0]
    for name, pl in (("shard", Shard(0)), ("replicate", Replicate())):
        local = {"layers.0.w": distribute_tensor(torch.full((4, 2), float(stage)), mesh2d["tp"], [pl])}
        try:
            ckptd.save(local, os.path.join(root, f"stages_{name}"))
            bad.append(f"saved two stages' different layers.0.w ({name}) as one")
        except ckptd.ShardingError as exc:
            if "is stored by several ranks with different values" not in str(exc):
                bad.append(f"wrong error for two stages' layers.0.w ({name}): {exc}")
        with ckptd.Checkpointer(os.path.join(root, f"stages_async_{name}")) as ckpt:
            try:
                ckpt.save(local, step=1).wait(timeout_s=60)
                bad.append(f"a Checkpointer saved two stages' different layers.0.w ({name}) as one")
            except ckptd.SaveFailedError as exc:
                if "is stored by several ranks with different values" not in str(exc):
                    bad.append(f"wrong async error for two stages' layers.0.w ({name}): {exc}")
    return bad


def _dtensors_load_at_2(rank: int, world: int, root: str) -> list[str]:
    from torch.distributed.tensor import Replicate, Shard

    full = _reference()
    placements = {
        "a": ("1d", [Shard(1)]),
        "b": ("1d", [Replicate()]),
        "c": ("1d", [Shard(0)]),
        "d": ("1d", [Shard(0)]),
        "f": ("1d", [Shard(0)]),
        "g": ("1d", [Replicate()]),
        "h": ("1d", [Shard(0)]),
        "i": ("1d", [Replicate()]),
    }
    bad = []
    for name in ("sync", "async/iter_0000003", "dcp"):
        req = _dtensor_state(world, placements, full, zero=True)
        ckptd.load(req, os.path.join(root, name))
        bad += _check_dtensor_state(req, full, f"world 2 ckptd.load of {name}")
    return bad


@pytest.mark.timeout(400)
def test_dtensor_state_dicts_across_meshes_and_world_sizes(tmp_path: Path, runtime_dir: Path):
    env = _async_env(runtime_dir)
    assert run_ranks(_dtensors_save_at_4, 4, str(tmp_path), timeout_s=240, env=env) == [[]] * 4
    assert run_ranks(_dtensors_load_at_2, 2, str(tmp_path), timeout_s=120) == [[]] * 2
    # World size 1, plain tensors: ckptd and torch DCP.
    import torch.distributed.checkpoint as dcp

    full = _reference()
    for name in ("sync", "async/iter_0000003"):
        req = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0, "opt": {"lr": 0, "betas": None}}
        ckptd.load(req, tmp_path / name)
        assert _check_dtensor_state(req, full, name) == []
        req = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0, "opt": {"lr": 0, "betas": None}}
        dcp.load(req, checkpoint_id=str(tmp_path / name), no_dist=True)
        assert _check_dtensor_state(req, full, f"dcp {name}") == []
    # Each chunk is stored once: replicas ("c" along dp, "d", the plain "e", "h" and "i" of each
    # data-parallel group) are written by one rank.
    from ckptd.format.dcp_metadata import read_index

    for name in ("sync", "async/iter_0000003"):
        index = read_index(tmp_path / name)
        assert [len(index.tensors[f"model.{k}"].chunks) for k in "abcdefhi"] == [4, 4, 2, 1, 1, 3, 2, 1], name
    assert ckptd.load_common_state_dict(tmp_path / "sync") == {"step": 7, "opt": {"lr": 0.1, "betas": [0.9, 0.95]}}


def _async_refusal_and_common_check(rank: int, world: int, root: str) -> list[str]:
    """Asynchronous saves: a value one rank cannot save fails the step on every rank, naming the key;
    a rank whose common state differs from rank 0's is reported on the committed handles."""
    import time

    bad = []
    with ckptd.Checkpointer(root) as ckpt:
        w = ckptd.ShardedTensor.from_rank_offsets("w", torch.ones(4) * rank, (0, rank, world))
        sd = {"w": w, "iteration": 1}
        if rank == 1:
            sd["opt"] = {"x": torch.ones(2).as_subclass(_Quantized)}
        t0 = time.monotonic()
        try:
            handle = ckpt.save(sd, step=1)
            if rank == 1:
                bad.append("rank 1 saved an unplaceable value")
            handle.wait(timeout_s=60)
            bad.append(f"rank {rank}: step 1 committed")
        except ckptd.ShardingError as exc:
            if rank != 1 or "'opt.x' is of type" not in str(exc):
                bad.append(f"rank {rank}: {exc}")
        except ckptd.SaveFailedError as exc:
            if rank != 0 or "rank 1 could not save step 1" not in str(exc) or "'opt.x'" not in str(exc):
                bad.append(f"rank {rank}: {exc}")
        if time.monotonic() - t0 > 30:  # commit_timeout_s is 600 s here: the abort came at once
            bad.append(f"rank {rank}: the failure took {time.monotonic() - t0:.0f} s")
        handle = ckpt.save({"w": w, "iteration": 2 + rank}, step=2)
        handle.wait(timeout_s=60)
        if not any("ranks [1] differs from rank 0's" in m for m in handle.warnings):
            bad.append(f"rank {rank}: warnings {handle.warnings}")
    return bad


class _Quantized(torch.Tensor):
    """A tensor subclass ckptd does not know."""


@pytest.mark.timeout(180)
def test_async_refusal_fails_every_rank_and_common_state_is_compared(tmp_path: Path, runtime_dir: Path):
    assert run_ranks(
        _async_refusal_and_common_check, 2, str(tmp_path / "root"), timeout_s=160, env=_async_env(runtime_dir)
    ) == [[], []]
