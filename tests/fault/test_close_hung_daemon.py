"""close(timeout_s) returns in time however the daemon hangs (issue 25, M9): a real daemon stopped
with SIGSTOP while a save waits for ring space behind a slow write. Before, close() reaped the
snapshot children with a blocking waitpid (fork snapshots) or waited for the lazy copier, and both
wait up to snapshot_timeout_s for ring space the stopped daemon never frees."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.client.checkpointer import CLOSE_MARGIN_S

SNAPSHOT_TIMEOUT_S = 20.0  # what a producer waits for ring space; close(timeout_s=3) must not


def _state(w: torch.Tensor, step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w), "iteration": step}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("snapshot", ["auto", "lazy"])
def test_close_honours_its_timeout_with_a_stopped_daemon(tmp_path, single_process, snapshot, runtime_dir):
    cfg = ckptd.CkptdConfig.from_env(
        {},
        runtime_dir=str(runtime_dir),
        snapshot=snapshot,
        staging_budget="1x",
        debug_write_delay_s=3.0,  # step 1 is still in the ring when the daemon stops
        snapshot_timeout_s=SNAPSHOT_TIMEOUT_S,
        idle_exit_s=2.0,
        heartbeat_s=0.2,
    )
    w = torch.randn(1024, 1024)  # 4 MiB: one save fills the ring
    others = {c.pid for c in psutil.Process().children()}  # the session's own (resource tracker)
    ckpt = ckptd.Checkpointer(tmp_path / "run", config=cfg)
    daemon = ckpt.status()["pid"]
    try:
        h1 = ckpt.save(_state(w, 1), step=1)
        h2 = ckpt.save(_state(w, 2), step=2)  # its producer waits for the ring space step 1 holds
        os.kill(daemon, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ckptd.SaveTimeoutError):
            ckpt.close(timeout_s=3.0)
        took = time.monotonic() - t0
        # The bound close() documents, far below the snapshot_timeout_s it waited before.
        assert took < 3.0 + CLOSE_MARGIN_S, took
        assert h1.status.value == h2.status.value == "aborted"
        # No snapshot child is left running (the one waiting for room was killed).
        assert not [
            c for c in psutil.Process().children() if c.pid not in others and c.status() != psutil.STATUS_ZOMBIE
        ]
    finally:
        os.kill(daemon, signal.SIGCONT)
        ckpt.close(wait=False)  # the runtime_dir fixture stops the daemon and checks what it left


@pytest.mark.timeout(120)
def test_close_finishes_its_teardown_when_a_step_of_it_raises(tmp_path, single_process, runtime_dir):
    """A step of close() raises (the lazy copier's stop: a sticky CUDA error in the fence, say):
    the connection, the staging ring and the finalizer are still released, the error reaches the
    caller, and a `with` block's own error is the one raised. Before, close() stopped there, and
    a second close() did nothing (the Checkpointer counted as closed)."""
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), snapshot="lazy", idle_exit_s=2.0)
    w = torch.randn(256, 256)
    ckpt = ckptd.Checkpointer(tmp_path / "run", config=cfg)
    ckpt.save(_state(w, 1), step=1).wait(timeout_s=60)

    def broken(deadline: float) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered (simulated)")

    ckpt._ring.stop_copier = broken
    ring = ckpt._ring.current
    with pytest.raises(RuntimeError, match="simulated"):
        ckpt.close()
    assert ckpt._ring.current is None and ring.segment._mm is None and not ckpt._link.connected
    assert not ckpt._finalizer.alive

    other = ckptd.Checkpointer(tmp_path / "run", config=cfg)
    other._ring.stop_copier = broken
    with pytest.raises(ValueError, match="the block's own"), other:
        raise ValueError("the block's own error")
    assert not other._link.connected
