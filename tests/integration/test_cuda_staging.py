"""The CUDA staging path: pinned shared-memory pool, device-to-host copies on a side stream.

Runs only where CUDA is available (skipped on CI's CPU machines; run on a GPU machine with
``python -m pytest tests/integration/test_cuda_staging.py``).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import ckptd
from ckptd import ShardedTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(180)
def test_cuda_shards_stage_pinned_and_commit_bit_exact(tmp_path, single_process):
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=tempfile.mkdtemp(prefix="cks", dir="/tmp"), idle_exit_s=2.0, heartbeat_s=0.2
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {f"w{i}": torch.randn(1 << 20, device="cuda", generator=gen) for i in range(8)}
    tensors["half"] = torch.randn(333, 77, device="cuda", generator=gen).to(torch.bfloat16)
    refs = {}
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        for step in (1, 2, 3):
            for t in tensors.values():
                t.add_(1)  # queued on the current stream: the save must copy after it
            refs[step] = {k: v.cpu() for k, v in tensors.items()}
            h = ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=step)
            for t in tensors.values():
                t.fill_(float("nan"))  # training overwrites on the GPU right after save() returned
            assert ckpt._pool is not None and ckpt._pool.pinned  # cudaHostRegister'ed slots
            h.wait(timeout_s=60)
            for k, v in refs[step].items():
                tensors[k].copy_(v)
        for step in (1, 3):
            want = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in tensors.items()}
            out = ckpt.load(want, step=step)
            for k, ref in refs[step].items():
                assert out[k].is_cuda and torch.equal(out[k].cpu(), ref), (step, k)


@pytest.mark.timeout(180)
def test_cuda_lazy_snapshots_are_fenced_by_the_stream_order(tmp_path, single_process):
    """snapshot="lazy": save() only enqueues the device-to-host copies; before_update() orders the
    next kernels after them (no host wait), so overwriting right after the fence is safe; a write
    before the fence fails the save."""
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=tempfile.mkdtemp(prefix="cks", dir="/tmp"), idle_exit_s=2.0, heartbeat_s=0.2, snapshot="lazy"
    )
    gen = torch.Generator(device="cuda").manual_seed(1)
    tensors = {f"w{i}": torch.randn(4 << 20, device="cuda", generator=gen) for i in range(4)}
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ref = {k: v.cpu() for k, v in tensors.items()}
        h = ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=1)
        ckpt.before_update()
        for t in tensors.values():
            t.fill_(float("nan"))  # ordered after the copies on the GPU
        h.wait(timeout_s=60)
        out = ckpt.load(
            {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in tensors.items()}, step=1
        )
        assert all(torch.equal(out[k].cpu(), ref[k]) for k in ref)
        h = ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=2)
        tensors["w0"].add_(1)  # before the fence: this save must fail, never commit torn values
        ckpt.before_update()
        with pytest.raises(ckptd.SaveFailedError, match="abandoned its snapshot of this save"):
            h.wait(timeout_s=60)
