"""The node daemon saves and commits without importing torch (README: Daemon memory).

torch and DCP's metadata classes cost a process about 190 MiB; the daemon writes tensor items
with ckptd.format.tensorzip and pickles ``.metadata`` with ckptd.format.dcp_pickle. A real daemon
serves Megatron-style and DCP-style saves here, then reports through ``ckptd status`` whether
``torch`` is in its ``sys.modules``; torch DCP loads what it committed.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd import ShardedObject, ShardedTensor
from ckptd.control.endpoints import JobEnv
from tests.cli import ckptd_cli


@pytest.mark.timeout(150)
def test_daemon_saves_and_commits_without_importing_torch(single):
    root, runtime, env = single
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime)
    w = torch.arange(4096, dtype=torch.bfloat16).reshape(64, 64)
    b = torch.arange(10, dtype=torch.int64)
    with ckptd.Checkpointer(root, config=cfg, env=JobEnv()) as ckpt:
        megatron = {
            "w": ShardedTensor.from_rank_offsets("w", w),
            "obj": ShardedObject("obj", {"lr": 0.1}, (1,), (0,)),
            "iteration": 1,
        }
        ckpt.save(megatron, step=1).wait(60)
        # DCP-style: plain tensors and values, planned and assigned to writers by the daemon.
        ckpt.save({"model": {"w": w, "b": b}, "step": 2}, step=2).wait(60)
        run = ckptd_cli(env, "status", str(root), "--json")
    assert run.returncode == 0, run.stderr
    (info,) = json.loads(run.stdout)["daemons"]
    assert info["metrics"]["steps_committed"] == 2
    assert info["torch_imported"] is False, "the node daemon imported torch while saving and committing"

    # torch DCP loads the daemon's .metadata and items.
    out = {"model": {"w": torch.zeros_like(w), "b": torch.zeros_like(b)}, "step": 0}
    dcp.load(out, checkpoint_id=str(root / "iter_0000002"))
    assert torch.equal(out["model"]["w"], w) and torch.equal(out["model"]["b"], b) and out["step"] == 2
