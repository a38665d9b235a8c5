"""A relaunch resumes the step its predecessor handed to the node daemons right before it crashed,
once they committed it (ckptd.client.settle), and does not wait for a step that cannot commit.

Real trainers (a process killed right after ``save()`` returned, or ranks that close without waiting),
a real daemon that outlives them and writes slowly (``debug_write_delay_s``), real gloo ranks.
Before, the relaunch resumed the step before, and its own save of the landed step was refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from tests.multiproc import without_torchrun
from tools.harness.ranks import run_ranks

WRITE_DELAY_S = 3.0  # each file the daemon writes: the relaunch asks long before step 10 commits


def _sd(w: torch.Tensor, rank: int = 0, world_size: int = 1) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world_size))}


def _values(step: int, rank: int = 0) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32) + step * 100 + rank * 0.5


_CRASHES_AFTER_HANDING_OFF = textwrap.dedent(
    """
    import os, sys
    import torch
    import ckptd
    from ckptd import ShardedTensor

    root, runtime, delay_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, debug_write_delay_s=delay_s, idle_exit_s=60.0)
    ckpt = ckptd.Checkpointer(root, config=cfg)
    for step in (5, 10):
        w = torch.arange(256, dtype=torch.float32) + step * 100
        h = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=step)
        if step == 5:
            h.wait(timeout_s=60)
    print("handed off", flush=True)
    os._exit(1)  # the trainer crashes; the daemon still writes and commits step 10
    """
)


@pytest.mark.timeout(120)
def test_a_relaunch_resumes_the_step_the_crashed_trainer_handed_off(tmp_path, single_process, runtime_dir):
    root = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHES_AFTER_HANDING_OFF, str(root), str(runtime_dir), str(WRITE_DELAY_S)],
        env=without_torchrun(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "handed off" in proc.stdout, proc.stdout + proc.stderr
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), resume_wait_s=60.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        assert ckpt.status()["pending_steps"] == [10]  # still in flight as the relaunch resumes
        out = ckpt.resume(_sd(torch.zeros(256)))
        assert out is not None and torch.equal(out["w"], _values(10))
        assert ckpt.latest() == 10
        ckpt.save(_sd(_values(20)), step=20).wait(timeout_s=60)  # the relaunch trains on from step 10


def _launch(rank: int, world_size: int, root: str, runtime: str, rank_1_hands_off: bool) -> None:
    """Both ranks commit step 5, then rank 0 (and rank 1 if ``rank_1_hands_off``) hands step 10 to
    the daemon, and both go away without waiting for it."""
    cfg = ckptd.CkptdConfig.from_env(
        {},
        runtime_dir=runtime,
        debug_write_delay_s=WRITE_DELAY_S,
        commit_timeout_s=40.0,  # what rank 1 never handed off aborts long after the relaunch resumed
        shutdown_grace_s=2.0,
        idle_exit_s=60.0,
    )
    ckpt = ckptd.Checkpointer(root, config=cfg)
    ckpt.save(_sd(_values(5, rank), rank, world_size), step=5).wait(timeout_s=60)
    if rank == 0 or rank_1_hands_off:
        ckpt.save(_sd(_values(10, rank), rank, world_size), step=10)
    try:
        ckpt.close(wait=False)  # as a crash: the daemon keeps what was handed off
    except ckptd.SaveFailedError as exc:  # step 10's handle: this rank stops waiting for it
        if rank == 0 or rank_1_hands_off:
            assert "closed before the step committed" in str(exc), exc
        else:
            raise


def _relaunch(rank: int, world_size: int, root: str, runtime: str) -> tuple[int, bool, float]:
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, resume_wait_s=60.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        t0 = time.monotonic()
        out = ckpt.resume(_sd(torch.zeros(256), rank, world_size))
        waited_s = time.monotonic() - t0
        assert out is not None
        step = int(out["w"][0].item()) // 100
        return step, torch.equal(out["w"], _values(step, rank)), waited_s


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rank_1_hands_off", [True, False], ids=["every-rank-handed-off", "rank-1-crashed-in-save"])
def test_a_relaunch_waits_only_for_a_step_every_rank_handed_off(tmp_path, runtime_dir, rank_1_hands_off):
    root, runtime = str(tmp_path / "run"), str(runtime_dir)
    run_ranks(_launch, 2, root, runtime, rank_1_hands_off, timeout_s=60)
    outcomes = run_ranks(_relaunch, 2, root, runtime, timeout_s=90)
    expected = 10 if rank_1_hands_off else 5
    assert [(step, exact) for step, exact, _ in outcomes] == [(expected, True)] * 2, outcomes
    if not rank_1_hands_off:
        # Step 10 can never commit (it aborts at commit_timeout_s): the relaunch did not wait for it.
        assert all(waited_s < 20.0 for _, _, waited_s in outcomes), outcomes
