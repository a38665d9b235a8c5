"""Issue 26.4: a relaunch that repeats its predecessor's attempt ids (a launcher that gives every
launch the same id) is never answered with the predecessor's verdict: after the root was emptied,
launch 2's save of step 1 is really committed, not a phantom COMMITTED with nothing on disk."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckptd
from ckptd import ShardedTensor


@pytest.mark.timeout(120)
def test_a_repeated_attempt_id_after_the_root_was_emptied_commits_for_real(tmp_path, single_process, runtime_dir):
    root = tmp_path / "run"
    runtime = str(runtime_dir)
    # One launch id for both launches (as plain torchrun's TORCHELASTIC_RUN_ID=none once gave):
    # the same attempt ids, sent to the same daemon, which outlives the first launch.
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, run_id="same-every-time", idle_exit_s=5.0)
    w = torch.arange(32.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        first = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=1)
        first.wait(timeout_s=30)
        daemon = ckpt.status()["pid"]
    shutil.rmtree(root)  # the user starts over in the same place
    w2 = w + 100
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        assert ckpt.status()["pid"] == daemon  # the same daemon, whose coordinator remembers step 1
        second = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w2)}, step=1)
        assert second.attempt == first.attempt
        second.wait(timeout_s=30)
        assert ckpt.latest() == 1
    assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000001")["w"], w2)


def _launch(rank: int, world_size: int, root: str, runtime: str) -> tuple[str, str, str]:
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=2.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        h = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, world_size))}, step=1)
        h.wait(timeout_s=60)  # committed: both ranks sent the same attempt id
        return ckpt._tries.incarnation.tag, ckpt._tries.incarnation.source, h.attempt


@pytest.mark.timeout(240)
def test_ranks_of_a_torchrun_launch_without_a_run_id_agree_on_a_fresh_incarnation(tmp_path, runtime_dir):
    """Plain torchrun (TORCHELASTIC_RUN_ID=none): the ranks agree through the process group's store,
    and the next launch gets another incarnation."""
    from tools.harness.ranks import run_ranks

    runtime = str(runtime_dir)
    env = {"TORCHELASTIC_RUN_ID": "none"}
    first = run_ranks(_launch, 2, str(tmp_path / "a"), runtime, env=env)
    second = run_ranks(_launch, 2, str(tmp_path / "b"), runtime, env=env)
    for launch in (first, second):
        assert len({tag for tag, _, _ in launch}) == 1
        assert all("torch.distributed store" in source for _, source, _ in launch)
    assert first[0][0] != second[0][0]


def _launch_after_one_rank_peeked(rank: int, world_size: int, root: str, runtime: str) -> tuple[str, str]:
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=2.0, commit_timeout_s=30.0)
    if rank == 0:  # rank 0 alone asks for the latest step first, with a Checkpointer of its own
        with ckptd.Checkpointer(root, config=cfg) as peek:
            assert peek.latest() is None
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        h = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, world_size))}, step=1)
        h.wait(timeout_s=60)  # committed: the reading Checkpointer took no part in the agreement
        return ckpt._tries.incarnation.tag, h.attempt


@pytest.mark.timeout(240)
def test_a_checkpointer_that_only_reads_on_one_rank_leaves_the_ranks_agreeing(tmp_path, runtime_dir):
    """Each rank's n-th Checkpointer agreed with the others' n-th: one rank's extra Checkpointer,
    made only to read, put that rank's saving one in another agreement, and no save of the launch
    committed ("ranks disagree on the save attempt")."""
    from tools.harness.ranks import run_ranks

    results = run_ranks(
        _launch_after_one_rank_peeked, 2, str(tmp_path / "a"), str(runtime_dir), env={"TORCHELASTIC_RUN_ID": "none"}
    )
    assert len(set(results)) == 1
