"""Issue 26.4: a relaunch that repeats its predecessor's attempt ids (a launcher that gives every
launch the same id) is never answered with the predecessor's verdict: after the root was emptied,
launch 2's save of step 1 is really committed, not a phantom COMMITTED with nothing on disk."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from tools.harness.ports import free_port
from tools.harness.ranks import launch_store, rank_env, spawn_queue, spawned


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


@pytest.mark.timeout(180)
def test_a_torchrun_restart_after_a_rank_died_before_saving_agrees_on_a_fresh_incarnation(tmp_path, runtime_dir):
    """Real torchrun, --max-restarts=1 (tests/integration/torchrun_rounds.py): its agent store
    outlives round 0. Rank 1 died in round 0 before its Checkpointer's first save, so in round 1 it
    counted one Checkpointer behind rank 0 and read round 0's incarnation: its re-save of step 10
    completed the dead round's attempt (committing the dead rank 0's shard with the new rank 1's),
    or the ranks disagreed and no save of the round committed. Now each round agrees on its own:
    one fresh tag on every rank; step 10 ends as any re-save of a step the dead round was still
    saving (aborted, never mixed), and step 20 commits round 1's values."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out, root = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(repo),
        "OMP_NUM_THREADS": "1",
        "CKPTD_RUNTIME_DIR": str(runtime_dir),
        "CKPTD_IDLE_EXIT_S": "5",
        "CKPTD_COMMIT_TIMEOUT_S": "30",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["-m", "tests.integration.torchrun_rounds", str(out), str(root)]
    run = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("round*-rank*.json")}
    assert set(seen) == {"round0-rank0", "round1-rank0", "round1-rank1"}, seen
    dead_tag = seen["round0-rank0"]["tag"]
    round1 = [seen["round1-rank0"], seen["round1-rank1"]]
    assert round1[0]["tag"] == round1[1]["tag"] != dead_tag, (dead_tag, round1)
    assert all(r["20"] == "committed" for r in round1), round1
    assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000020")["w"], torch.tensor([0.0] * 4 + [1.0] * 4))
    assert all("ranks disagree" in r["10"] and dead_tag in r["10"] for r in round1), round1
    assert not (root / "iter_0000010").exists()  # the dead round's shard never committed with round 1's


def _elastic_rank(
    launch: dict[str, str], rank: int, world_size: int, restarts: int, root: str, step: int, queue: Any
) -> None:
    """Rank ``rank`` of an elastic round of ``world_size`` one-rank nodes (a torchrun agent each, on
    this machine), as torchrun starts it (its variables, the agent store of ``launch``): saves
    ``step`` and reports its incarnation and the save's outcome."""
    os.environ.update(launch)
    os.environ.update(rank_env(rank, world_size, int(launch["MASTER_PORT"])))
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(restarts)  # each agent's own count
    tag, outcome = None, "committed"
    try:
        with ckptd.Checkpointer(root) as ckpt:
            state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(step)), (0, rank, world_size))}
            handle = ckpt.save(state, step=step)
            tag = ckpt._tries.incarnation.tag
            handle.wait(timeout_s=45)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = f"{type(exc).__name__}: {exc}"
    queue.put((rank, tag, outcome))


ROUND_S = 70.0  # each round's bound: 3 rounds, each with its reaping, end before the test's timeout


@pytest.mark.timeout(300)
def test_elastic_rounds_of_torchruns_on_several_nodes_agree_on_a_fresh_incarnation_each(tmp_path, runtime_dir):
    """One agent store for three rounds, as torchrun's c10d rendezvous keeps it: 2 nodes; a third
    joins (a membership change: no agent counts a restart); node 0's worker fails and its agent
    restarts alone (its count 1, the others' 0). Ranks new to the job counted their Checkpointers
    from 0 where the others had counted one already: in the 3-node round rank 2 read the 2-node
    round's incarnation and no save of the round committed ("ranks disagree"). Now each world size
    has its own agreement; agents' restart counts, which differ between nodes, are not used."""
    store = launch_store()
    launch = {
        "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "none",
        "CKPTD_RUNTIME_DIR": str(runtime_dir),
        "CKPTD_COORDINATOR_PORT": str(free_port()),
        "CKPTD_IDLE_EXIT_S": "5",
        "CKPTD_COMMIT_TIMEOUT_S": "30",
    }
    root = str(tmp_path / "run")
    rounds = []
    for step, restarts in ((1, [0, 0]), (2, [0, 0, 0]), (3, [1, 0, 0])):
        queue = spawn_queue()
        world = len(restarts)
        targets = [(_elastic_rank, (launch, r, world, restarts[r], root, step, queue)) for r in range(world)]
        deadline = time.monotonic() + ROUND_S
        with spawned(targets, join_timeout_s=20):
            reports = [queue.get(timeout=max(0.0, deadline - time.monotonic())) for _ in range(world)]
        got = {rank: (tag, outcome) for rank, tag, outcome in reports}
        tags = [got[r][0] for r in range(world)]
        rounds.append(tags)
        assert len(set(tags)) == 1 and None not in tags, (step, got, rounds)  # one tag on every rank
        assert all(outcome == "committed" for _, outcome in got.values()), (step, got)
    assert len({tags[0] for tags in rounds}) == 3, rounds
    full = ckptd.load_plain_tensors(tmp_path / "run" / "iter_0000002")["w"]
    assert torch.equal(full, torch.full((12,), 2.0))
