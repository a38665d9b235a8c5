"""State that only some ranks hold is stored as torch DCP stores it (2 real gloo ranks).

ckptd.save, a Checkpointer and dcp.save of the same state dicts must store the same keys, and
each rank must load back what it saved: an FSDP2 model's and AdamW's full state dict
(``full_state_dict=True, cpu_offload=True``: rank 0 holds everything, rank 1 nothing), a key
only rank 1 holds, and TorchTitan's per-rank dataloader state. A Checkpointer whose ranks hold
the same plain keys writes each once after the first commit confirmed that; a rank whose keys
change afterwards fails that save naming the key, and the next save stores everything again.
The pure rules are in tests/unit/test_plain_holdings.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _env(runtime_dir: Path) -> dict[str, str]:
    return {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "2"}


def _stored_keys(directory: str) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(directory).read_metadata().state_dict_metadata)


def _committed(root: str, step: int) -> str:
    from ckptd.format.rootlayout import step_dir_name

    return str(Path(root) / step_dir_name(step))


def _full_state_dict_round_trip(rank: int, world: int, root: str) -> list[str]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    import ckptd
    from tests.integration.titan import build, full_params, train_step

    model, optimizer = build(0, world)
    train_step(model, optimizer, 1)
    expected = full_params(model)
    expected_optim = {
        k: {n: t.to_local().clone() for n, t in s.items() if n != "step"}
        for k, s in get_optimizer_state_dict(model, optimizer)["state"].items()
    }
    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    sd = {"model": model_sd, "optim": optim_sd}
    problems = []
    if rank == 1 and model_sd:
        problems.append(f"rank 1 holds {len(model_sd)} model entries: the test does not test what it should")
    dcp.save(sd, checkpoint_id=f"{root}/dcp")
    ckptd.save(sd, f"{root}/sync")
    with ckptd.Checkpointer(f"{root}/async") as ckpt:
        ckpt.save(sd, step=1).wait(timeout_s=120)
    dist.barrier()
    reference = _stored_keys(f"{root}/dcp")
    for name, directory in (("sync", f"{root}/sync"), ("async", _committed(f"{root}/async", 1))):
        keys = _stored_keys(directory)
        if keys != reference:
            problems.append(
                f"{name}: keys {sorted(reference - keys)[:5]} missing, {sorted(keys - reference)[:5]} extra"
            )
            continue
        fresh, fresh_optimizer = build(1, world)
        train_step(fresh, fresh_optimizer, 99)  # optimizer state to load into
        model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
        request = {"model": model_sd, "optim": optim_sd}
        ckptd.load(request, directory)
        set_state_dict(fresh, fresh_optimizer, model_state_dict=request["model"], optim_state_dict=request["optim"])
        if not all(torch.equal(a, b) for a, b in zip(full_params(fresh), expected)):
            problems.append(f"{name}: the model did not come back")
        got = get_optimizer_state_dict(fresh, fresh_optimizer)["state"]
        for k, s in expected_optim.items():
            if any(not torch.equal(got[k][n].to_local(), t) for n, t in s.items()):
                problems.append(f"{name}: optimizer state of {k} did not come back")
    return problems


@pytest.mark.timeout(400)
def test_an_fsdp2_full_state_dict_on_rank_0_only_is_stored_and_loads(tmp_path: Path, runtime_dir: Path):
    assert run_ranks(_full_state_dict_round_trip, 2, str(tmp_path), timeout_s=360, env=_env(runtime_dir)) == [[], []]


def _state(rank: int, fill: float) -> dict:
    import pickle

    import torch

    model = {"w": torch.full((3, 4), fill)}
    if rank == 1:
        model["only_on_rank1"] = torch.arange(6.0) + fill
    return {
        "model": model,
        "train_state": {"step": int(fill)},
        "dataloader": {f"dp_rank_{rank}": pickle.dumps({"position": int(fill) * 10 + rank}), "world_size": 2},
    }


def _same(a: dict, b: dict) -> bool:
    import torch

    from ckptd.statedict.tree import iter_leaves

    la, lb = dict(iter_leaves(a)), dict(iter_leaves(b))
    return la.keys() == lb.keys() and all(
        torch.equal(x, lb[k]) if isinstance(x, torch.Tensor) else x == lb[k] for k, x in la.items()
    )


def _per_rank_state_round_trip(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptd

    problems = []
    saved = _state(rank, 7.0)
    dcp.save(saved, checkpoint_id=f"{root}/dcp")
    ckptd.save(saved, f"{root}/sync")
    with ckptd.Checkpointer(f"{root}/async") as ckpt:
        ckpt.save(saved, step=7).wait(timeout_s=120)
        ckpt.save(_state(rank, 8.0), step=8).wait(timeout_s=120)  # the digests differ: every rank writes all
    dist.barrier()
    reference = _stored_keys(f"{root}/dcp")
    if "model.only_on_rank1" not in reference or "dataloader.dp_rank_1" not in reference:
        problems.append(f"dcp.save stored {sorted(reference)}")
    for name, directory, value in (
        ("sync", f"{root}/sync", 7.0),
        ("async", _committed(f"{root}/async", 7), 7.0),
        ("async again", _committed(f"{root}/async", 8), 8.0),
        ("dcp", f"{root}/dcp", 7.0),
    ):
        if name != "dcp" and _stored_keys(directory) != reference:
            problems.append(f"{name}: stored {sorted(_stored_keys(directory))}, dcp.save {sorted(reference)}")
        request = _state(rank, 0.0)
        ckptd.load(request, directory)
        if not _same(request, _state(rank, value)):
            problems.append(f"{name}: rank {rank} did not get its state back")
        if name == "sync":
            request = _state(rank, 0.0)
            dcp.load(request, checkpoint_id=directory)
            if not _same(request, _state(rank, value)):
                problems.append(f"dcp.load of ckptd's checkpoint: rank {rank} did not get its state back")
    # Ranks that hold different values under one key: the lowest rank's is stored, with a warning.
    ckptd.save({"seed": 100 + rank}, f"{root}/differ-sync")
    with ckptd.Checkpointer(f"{root}/differ-async") as ckpt:
        handle = ckpt.save({"seed": 100 + rank}, step=1)
        handle.wait(timeout_s=120)
    if not any("'seed'" in w and "only rank 0's is stored" in w for w in handle.warnings):
        problems.append(f"no warning about the differing copies: {handle.warnings}")
    for directory in (f"{root}/differ-sync", _committed(f"{root}/differ-async", 1)):
        if ckptd.load({"seed": -1}, directory)["seed"] != 100:
            problems.append(f"{directory}: rank {rank} did not get rank 0's seed")
    return problems


@pytest.mark.timeout(300)
def test_per_rank_keys_and_dataloader_state_are_stored_for_every_rank(tmp_path: Path, runtime_dir: Path):
    assert run_ranks(_per_rank_state_round_trip, 2, str(tmp_path), timeout_s=260, env=_env(runtime_dir)) == [[], []]


def _uniform(fill: float, with_b: bool = True) -> dict:
    import torch

    sd = {"a": torch.full((25,), fill), "step": int(fill)}  # a: 100 bytes -> rank 0, b: 60 bytes -> rank 1
    if with_b:
        sd["b"] = torch.full((15,), fill)
    return sd


def _spread_then_change(rank: int, world: int, root: str) -> list[str]:
    import os

    import torch.distributed as dist

    import ckptd

    problems = []
    sizes = {}
    with ckptd.Checkpointer(root) as ckpt:
        for step in (1, 2):
            ckpt.save(_uniform(float(step)), step=step).wait(timeout_s=120)
            sizes[step] = os.path.getsize(Path(_committed(root, step)) / f"__{rank}_0.distcp")
        if rank == 0:  # the copies nobody references are invisible to a reader
            from ckptd.verify import verify_checkpoint

            report = verify_checkpoint(_committed(root, 1))
            if not report.ok:
                problems.append(f"verify: {[f.message for f in report.findings]}")
        if rank == 1 and not sizes[2] < sizes[1]:
            problems.append(f"rank 1 wrote {sizes[1]} then {sizes[2]} bytes: it did not leave 'a' to rank 0")
        # Rank 1 drops 'b', which the confirmed assignment left to it: nobody would store it.
        handle = ckpt.save(_uniform(3.0, with_b=rank == 0), step=3)
        try:
            handle.wait(timeout_s=120)
            problems.append("step 3 committed without 'b'")
        except ckptd.SaveFailedError as exc:
            if "'b' (held by ranks [0])" not in str(exc) or "plain keys changed" not in str(exc):
                problems.append(f"step 3 failed for another reason: {exc}")
        dist.barrier()
        ckpt.save(_uniform(4.0, with_b=rank == 0), step=4).wait(timeout_s=120)
        request = _uniform(0.0, with_b=rank == 0)
        ckpt.load(request, step=4)
        if not _same(request, _uniform(4.0, with_b=rank == 0)):
            problems.append(f"rank {rank}: step 4 did not load back")
    return problems


@pytest.mark.timeout(300)
def test_plain_items_are_spread_once_confirmed_and_a_changed_rank_cannot_drop_one(tmp_path: Path, runtime_dir: Path):
    assert run_ranks(_spread_then_change, 2, str(tmp_path / "run"), timeout_s=260, env=_env(runtime_dir)) == [[], []]


def _no_main_replica(rank: int, world: int, root: str) -> list[str]:
    import torch

    import ckptd
    from ckptd import ShardedObject, ShardedTensor

    def state() -> dict:
        return {
            "w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, rank, world)),
            "emb": ShardedTensor.from_rank_offsets("emb", torch.ones(4), replica_id=rank + 1),
            "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,), replica_id=1),
        }

    problems = []
    expected = ["3 key(s) would not be stored", "'emb' (held by ranks [0, 1])", "'rng/shard_1_2' (held by ranks [1])"]
    try:
        ckptd.save(state(), f"{root}/sync")
        problems.append("ckptd.save stored a checkpoint without 'emb' and 'rng'")
    except ckptd.ShardingError as exc:
        problems += [f"sync: {e!r} not in {exc}" for e in expected if e not in str(exc)]
    with ckptd.Checkpointer(f"{root}/async") as ckpt:
        try:
            ckpt.save(state(), step=1).wait(timeout_s=120)
            problems.append("the Checkpointer committed a checkpoint without 'emb' and 'rng'")
        except ckptd.SaveFailedError as exc:
            problems += [f"async: {e!r} not in {exc}" for e in expected if e not in str(exc)]
        sd = state()
        sd["emb"] = ShardedTensor.from_rank_offsets("emb", torch.ones(4), replica_id=rank)  # rank 0: main
        sd["rng"] = ShardedObject("rng", {"seed": rank}, (world,), (rank,))
        ckpt.save(sd, step=2).wait(timeout_s=120)  # the same keys with a main replica commit
    return problems


@pytest.mark.timeout(300)
def test_keys_every_rank_holds_only_as_replicas_are_refused_naming_them(tmp_path: Path, runtime_dir: Path):
    assert run_ranks(_no_main_replica, 2, str(tmp_path), timeout_s=260, env=_env(runtime_dir)) == [[], []]
