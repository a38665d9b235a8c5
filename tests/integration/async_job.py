"""A simulated multi-node job for the asynchronous-save tests: rank environments, state, checks.

Ranks are real processes; "nodes" are distinct GROUP_RANKs on this machine, each with its own
real node daemon (auto-started by its local rank 0), node 0's daemon hosting the coordinator.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ckptd import ShardedObject, ShardedTensor
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv, default_job_id
from ckptd.staging.segment import list_segments
from tools.harness.daemons import daemon_processes

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
ROWS, COLS = 8, 64  # "w": float32 rows split over ranks
BLEN = 16  # "b": bfloat16 split over ranks


def set_rank_env(rank: int, env: dict[str, str]) -> None:
    """torchrun's variables for ``rank`` of a NODES x PER_NODE job, plus the test's CKPTD_* knobs."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        GROUP_RANK=str(rank // PER_NODE),
        MASTER_ADDR="127.0.0.1",
    )


def full_w(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 + step * 1000


def full_b(step: int) -> torch.Tensor:
    return (torch.arange(BLEN, dtype=torch.float32) / 8 + step).to(torch.bfloat16)


def full_emb(step: int) -> torch.Tensor:
    return torch.arange(15, dtype=torch.int64).reshape(3, 5) * (step + 1)


def rank_state(rank: int) -> dict[str, torch.Tensor]:
    """This rank's live training tensors (mutated in place between saves)."""
    rows, blen = ROWS // WORLD, BLEN // WORLD
    return {
        "w": torch.zeros(rows, COLS),
        "b": torch.zeros(blen, dtype=torch.bfloat16),
        "emb": torch.zeros(3, 5, dtype=torch.int64),
    }


def fill(state: dict[str, torch.Tensor], rank: int, step: int) -> None:
    rows, blen = ROWS // WORLD, BLEN // WORLD
    state["w"].copy_(full_w(step)[rank * rows : (rank + 1) * rows])
    state["b"].copy_(full_b(step)[rank * blen : (rank + 1) * blen])
    state["emb"].copy_(full_emb(step))


def sharded(state: dict[str, torch.Tensor], rank: int, step: int) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", state["w"], (0, rank, WORLD)),
        "b": ShardedTensor.from_rank_offsets("b", state["b"], (0, rank, WORLD)),
        "emb": ShardedTensor.from_rank_offsets("emb", state["emb"], replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (WORLD,), (rank,)),
        "iteration": step,
    }


def request(rank: int) -> dict:
    """A load request for ``rank``'s shards (fresh tensors)."""
    st = rank_state(rank)
    for t in st.values():
        t.fill_(-7)
    return sharded(st, rank, -1)


def check_loaded(loaded: dict, rank: int, step: int) -> None:
    rows, blen = ROWS // WORLD, BLEN // WORLD
    assert torch.equal(loaded["w"], full_w(step)[rank * rows : (rank + 1) * rows]), (rank, step)
    assert torch.equal(loaded["b"], full_b(step)[rank * blen : (rank + 1) * blen]), (rank, step)
    assert torch.equal(loaded["emb"], full_emb(step)), (rank, step)
    assert loaded["rng"] == {"rank": rank, "step": step}, loaded["rng"]
    assert loaded["iteration"] == step


def endpoints(root: Path, env: dict[str, str], node: int) -> Endpoints:
    cfg = CkptdConfig.from_env(env)
    job = JobEnv(
        rank=node * PER_NODE,
        local_rank=0,
        world_size=WORLD,
        local_world_size=PER_NODE,
        node=node,
        master_addr="127.0.0.1",
        master_port=0,
    )
    return Endpoints.for_job(root, job, cfg)


def leftovers(root: Path, eps: list[Endpoints]) -> dict[str, list]:
    """Everything a stopped job must not leave: segments, socket/pid files, processes."""
    job = default_job_id(root)
    return {
        "segments": list_segments(f"ckptd-{job}-"),
        "files": [str(f) for ep in eps for f in (ep.socket_path, ep.pid_path) if f.exists()],
        "processes": daemon_processes(job),
    }
