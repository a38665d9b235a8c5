"""What the ranks of another node are told when the coordinator dies right after its commit point:
the truth. 2 simulated nodes x 1 rank, real daemons, real ZeroMQ, real files.

Node 0's daemon (the coordinator) renames ``iter_0000002`` into place and hangs writing the
``latest`` tracker (its fault file's ``hang`` rule); rank 0 then SIGKILLs it, so STEP_COMMITTED is
never sent. Node 1's daemon loses its coordinator, either by its silence (``lost``) or by seeing a
restarted one (``restarted``: rank 0 restarts its daemon at once, and the coordinator timeout is
long enough that only the new instance can tell node 1). Before telling its rank anything, node
1's daemon asks the root whether that attempt committed: rank 1's save resolves COMMITTED with a
warning (it used to fail with SaveFailedError although ``iter_0000002`` was committed), rank 0's
says its daemon died but the checkpoint is complete, both load step 2 bit-exact and save on.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd import ShardedTensor
from tests.fault.test_node_faults import as_node_rank
from tools.harness.ports import free_port
from tools.harness.ranks import run_ranks
from tools.harness.waiting import wait_for_exit, wait_until

COMMIT_TIMEOUT_S = 8.0
COORDINATOR_TIMEOUT_S = {"lost": 2.0, "restarted": 60.0}


def _w(rank: int, step: int) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).reshape(4, 8) * 0.25 + step * 10 + rank


def _sd(rank: int, step: int, w: torch.Tensor | None = None) -> dict:
    w = _w(rank, step) if w is None else w
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)), "iteration": step}


def _check(ckpt: ckptd.Checkpointer, rank: int, step: int) -> None:
    out = ckpt.load(_sd(rank, -1, torch.zeros(4, 8)), step=step)
    assert torch.equal(out["w"], _w(rank, step)) and out["iteration"] == step


def _lose_the_coordinator_after_its_commit(rank: int, world: int, env: dict, root: str, faults: str, how: str) -> dict:
    fault_file = as_node_rank(rank, env, faults)
    out: dict = {}
    ckpt = ckptd.Checkpointer(root)
    try:
        ckpt.save(_sd(rank, 1), step=1).wait(timeout_s=60)
        log_path = ckpt.endpoints.log_path
        restarts_seen = log_path.read_text().count("coordinator restarted")
        if rank == 0:
            pid = ckpt.status()["pid"]
            fault_file.write_text("hang latest.tmp\n")  # the tracker's write: after the rename
        dist.barrier()
        h = ckpt.save(_sd(rank, 2), step=2)
        if rank == 0:
            wait_until(lambda: "injected fault: the open of" in log_path.read_text(), 60, "the tracker's write")
            os.kill(pid, signal.SIGKILL)
            wait_for_exit(pid, 30, "node 0's daemon to exit")
            fault_file.unlink()
            with pytest.raises(ckptd.SaveFailedError) as err:
                h.wait(timeout_s=30)
            out["error"] = str(err.value)
            if how == "restarted":
                assert ckpt.status()["pid"] != pid  # the next call starts node 0's daemon again
        else:
            try:
                h.wait(timeout_s=60)
                out["status"], out["warnings"] = h.status.name, h.warnings
            except ckptd.SaveFailedError as exc:  # what the old code said
                out["status"], out["error"] = h.status.name, str(exc)
        dist.barrier()
        if rank == 0:
            assert ckpt.status()["pid"] != pid
        else:  # node 1's daemon learns the restarted coordinator at its next ping
            wait_until(
                lambda: log_path.read_text().count("coordinator restarted") > restarts_seen,
                30,
                "node 1's daemon to learn of the restarted coordinator",
            )
        dist.barrier()
        out["latest"] = ckpt.latest()  # the restarted coordinator made iter_0000002 latest
        _check(ckpt, rank, 2)
        ckpt.save(_sd(rank, 3), step=3).wait(timeout_s=60)
        assert ckpt.latest() == 3
        for step in (1, 2, 3):
            _check(ckpt, rank, step)
    finally:
        ckpt.close(wait=False)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["lost", "restarted"])
def test_ranks_of_another_node_see_committed_when_the_coordinator_died_after_its_commit(tmp_path, how, runtime_dir):
    root = tmp_path / "ckpts"
    env = {
        "CKPTD_RUNTIME_DIR": str(runtime_dir),
        "CKPTD_COORDINATOR_PORT": str(free_port()),
        "CKPTD_HEARTBEAT_S": "0.1",
        "CKPTD_COMMIT_TIMEOUT_S": str(COMMIT_TIMEOUT_S),
        "CKPTD_COORDINATOR_TIMEOUT_S": str(COORDINATOR_TIMEOUT_S[how]),
        "CKPTD_IDLE_EXIT_S": "60",
    }
    out = run_ranks(_lose_the_coordinator_after_its_commit, 2, env, str(root), str(tmp_path), how, timeout_s=150)
    assert out[1]["status"] == "COMMITTED", out[1]
    (warning,) = out[1]["warnings"]
    cause = "did not answer for" if how == "lost" else "the coordinator restarted"
    assert cause in warning and "the root holds iter_0000002 committed by attempt" in warning, warning
    assert "step 2 was not confirmed" in out[0]["error"] and "is complete" in out[0]["error"], out[0]
    assert out[0]["latest"] == out[1]["latest"] == 2
