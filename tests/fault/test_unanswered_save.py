"""A SAVE whose answer never came (the daemon busy past ``request_timeout_s``, an interrupt): the
daemon may have taken it, so its staging block stays reserved; the producer must not leave it
unsealed. Before, an in-``save()`` copy left it so: the daemon waited ``snapshot_timeout_s`` for a
seal that never came, and every later save of the rank queued behind it.

A real daemon and Checkpointer; the lost answer is made by raising after the real SAVE_ACK came.
"""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import DaemonError


def _sd(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4096,), value))}


@pytest.mark.timeout(120)
def test_a_save_whose_answer_was_lost_fails_at_once_and_the_next_save_commits(tmp_path, single_process, runtime_dir):
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=str(runtime_dir), snapshot="copy", snapshot_timeout_s=300.0, idle_exit_s=2.0
    )
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.save(_sd(1.0), step=1).wait(timeout_s=30)
        announce = ckpt._link.announce

        def answer_lost(msg):
            announce(msg)  # the daemon took it
            raise DaemonError("no answer within request_timeout_s (simulated)")

        ckpt._link.announce = answer_lost
        with pytest.raises(DaemonError, match="simulated"):
            ckpt.save(_sd(2.0), step=2)
        ckpt._link.announce = announce
        # Within seconds, not after snapshot_timeout_s: step 2's block was given up at once.
        ckpt.save(_sd(3.0), step=3).wait(timeout_s=30)
        assert ckpt.latest() == 3
        out = ckpt.load(_sd(0.0), step=3)
        assert torch.equal(out["w"], torch.full((4096,), 3.0))
