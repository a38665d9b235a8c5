"""torch DCP's Stateful objects, as TorchTitan hands them over (2 real gloo ranks).

A ModelWrapper over an FSDP2 model, an optimizer container, a train state of ints and a
dataloader whose state is keyed per rank are saved by ckptd.save, by a Checkpointer (whose
snapshot is of what ``state_dict()`` returned at ``save()``: the objects change right after) and
by dcp.save; every checkpoint is loaded by ckptd.load and by dcp.load into fresh objects, whose
``load_state_dict()`` must have been called with the saved state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _objects(rank: int, world: int, seed: int) -> dict:
    from tests.integration.titan import Dataloader, ModelWrapper, OptimizersContainer, TrainState, build, train_step

    model, optimizer = build(seed, world)
    train_step(model, optimizer, 1 if seed == 0 else 99)  # a fresh optimizer needs state to load into
    return {
        "model": ModelWrapper(model),
        "optimizer": OptimizersContainer(model, optimizer),
        "train_state": TrainState(),
        "dataloader": Dataloader(rank, world),
    }


def _values(states: dict) -> dict:
    from tests.integration.titan import full_params

    model = states["model"].model
    optimizer = states["optimizer"].optimizer
    return {
        "params": full_params(model),
        "optimizer": [t.to_local().clone() for s in optimizer.state.values() for t in s.values() if t.dim()],
        "train_state": states["train_state"].state_dict(),
        "position": states["dataloader"].position,
    }


def _equal(a: dict, b: dict) -> bool:
    import torch

    return (
        all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        and all(torch.equal(x, y) for x, y in zip(a["optimizer"], b["optimizer"]))
        and len(a["optimizer"]) == len(b["optimizer"]) > 0
        and (a["train_state"], a["position"]) == (b["train_state"], b["position"])
    )


def _stateful_round_trips(rank: int, world: int, root: str) -> list[str]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptd
    from ckptd.format.rootlayout import step_dir_name
    from tests.integration.titan import train_step

    states = _objects(rank, world, seed=0)
    states["train_state"].step, states["train_state"].ntokens_seen = 1, 4096
    states["dataloader"].next_batch()
    saved = _values(states)
    ckptd.save(states, f"{root}/sync")
    dcp.save(states, checkpoint_id=f"{root}/dcp")
    with ckptd.Checkpointer(f"{root}/async") as ckpt:
        handle = ckpt.save(states, step=1)
        # Training goes on at once: the checkpoint holds the state at save().
        train_step(states["model"].model, states["optimizer"].optimizer, 2)
        states["train_state"].step = 2
        states["dataloader"].next_batch()
        handle.wait(timeout_s=120)
    dist.barrier()
    problems = []
    if _equal(_values(states), saved):
        problems.append("training did not change the state: the test does not test what it should")
    loaders = {"ckptd.load": lambda sd, d: ckptd.load(sd, d), "dcp.load": lambda sd, d: dcp.load(sd, checkpoint_id=d)}
    for name, directory in (
        ("ckptd.save", f"{root}/sync"),
        ("Checkpointer", f"{root}/async/{step_dir_name(1)}"),
        ("dcp.save", f"{root}/dcp"),
    ):
        for how, load in loaders.items():
            if (name, how) == ("dcp.save", "dcp.load"):
                continue
            fresh = _objects(rank, world, seed=1)
            request = dict(fresh)
            load(request, directory)
            if any(request[k] is not fresh[k] for k in fresh):
                problems.append(f"{how} of {name}'s checkpoint replaced a Stateful object in the dict")
            if any(obj.loaded != 1 for obj in fresh.values()):
                problems.append(f"{how} of {name}'s checkpoint: load_state_dict() was not called once on each")
            if not _equal(_values(fresh), saved):
                problems.append(f"{how} of {name}'s checkpoint: rank {rank} did not get the saved state back")
    return problems


@pytest.mark.timeout(600)
def test_stateful_objects_save_and_load_as_dcp_does_both_ways(tmp_path: Path, runtime_dir):
    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "2"}
    assert run_ranks(_stateful_round_trips, 2, str(tmp_path), timeout_s=560, env=env) == [[], []]
