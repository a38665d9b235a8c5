"""The node daemon hides the GPUs from itself: nothing it runs can create a CUDA context (host
memory, and device memory on every GPU of the node). Real auto-started daemon."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd import ShardedTensor


@pytest.mark.timeout(120)
def test_the_daemon_runs_with_no_visible_gpu(tmp_path, single_process, runtime_dir):
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1000))}, step=1).wait(timeout_s=60)
        pid = ckpt.status()["pid"]
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        assert env.get(b"CUDA_VISIBLE_DEVICES") == b""
        with open(f"/proc/{pid}/maps") as f:
            assert "libcuda.so" not in f.read()  # no CUDA driver loaded (on a GPU machine too)
