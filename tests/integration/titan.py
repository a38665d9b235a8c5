"""A small FSDP2 model and TorchTitan-like ``Stateful`` objects (for spawned gloo ranks).

TorchTitan's CheckpointManager hands DCP a dict of Stateful objects: a ModelWrapper (its
``state_dict()`` is ``get_model_state_dict(model)``), an OptimizersContainer
(``get_optimizer_state_dict``), a TrainState of ints, a LR scheduler container, and the
dataloader, whose state is keyed per data-parallel rank (``{"dp_rank_<r>": pickled bytes,
"world_size": n}``). These classes do the same on a small FSDP2 model. Imported only inside
spawned ranks.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 5)
        self.register_buffer("scale", torch.ones(5))  # a plain tensor every rank holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.scale


def build(seed: int, world: int) -> tuple[Net, torch.optim.Optimizer]:
    """An FSDP2 model over all ranks (its parameters DTensors) and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.fc1, model.fc2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: Net, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(step * 10 + dist.get_rank())
    loss = model(torch.randn(4, 6, generator=gen)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        model.scale.add_(0.5)


def full_params(model: Net) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in model.parameters()] + [model.scale.clone()]


class ModelWrapper:
    """TorchTitan's ModelWrapper: the model's DCP state dict, loaded back with set_model_state_dict."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=StateDictOptions(strict=True))
        self.loaded += 1


class OptimizersContainer:
    """TorchTitan's OptimizersContainer over one optimizer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)
        self.loaded += 1


class TrainState:
    """TorchTitan's TrainState: the step and the tokens seen, plain ints."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0
        self.loaded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]
        self.loaded += 1


class Dataloader:
    """TorchTitan's ParallelAwareDataloader: its position, saved per data-parallel rank."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.position = 0
        self.loaded = 0

    def next_batch(self) -> None:
        self.position += 1 + self.rank  # each rank reads its own shard of the data

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"position": self.position}), "world_size": self.world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["world_size"] != self.world:
            raise ValueError("the data-parallel degree changed")
        self.position = pickle.loads(state_dict[f"dp_rank_{self.rank}"])["position"]
        self.loaded += 1
