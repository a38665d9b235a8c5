"""Guarantee 2 by crash injection (tools/harness/crash_trial.py, also run by tools/crash_matrix.py).

The default suite runs a short matrix: one trial per victim kind (a trainer rank, a non-coordinator
node daemon, node 0's daemon with the coordinator) plus one random victim, with a fixed seed. The
long matrix (30 trials, 4 ranks on 2 nodes) is opt-in: ``pytest -m slow``. A third test proves the
checker itself finds corruption and loss, so a green matrix means something.
"""

from __future__ import annotations

import shutil
import zlib

import pytest

from ckptd.format.finalize import serialize_common, write_rank_files
from ckptd.format.items import PlannedItem, plan_object, plan_tensor_items
from ckptd.format.layout import data_file_name
from ckptd.format.rootlayout import tmp_dir
from ckptd.roots.posix import commit_step
from tests.checkpoints import flip_bit
from tools.harness import crash_job as cj
from tools.harness import crash_trial as ct


@pytest.fixture(scope="module")
def ctx():
    context = ct.process_context()
    yield context
    ct.stop_process_context()


@pytest.mark.timeout(240)
def test_short_crash_matrix_every_victim_kind(ctx, tmp_path):
    results = [
        ct.run_trial(1000 + i, ct.LoopbackHosts(ctx), ranks=2, nodes=2, victim=victim, workdir=tmp_path)
        for i, victim in enumerate(["rank", "node", "coordinator", None])
    ]
    assert not ct.failures(results), "\n".join(ct.failures(results))
    assert {r.victim for r in results} >= set(ct.VICTIMS)
    assert sum(r.commits for r in results) > 0 and all(r.recovered for r in results)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_long_crash_matrix(ctx, tmp_path):
    results = [ct.run_trial(seed, ct.LoopbackHosts(ctx), ranks=4, nodes=2, workdir=tmp_path) for seed in range(30)]
    assert not ct.failures(results), "\n".join(ct.failures(results))
    assert {r.victim for r in results} == set(ct.VICTIMS)


# --- the checker finds what it must find ---------------------------------------------------------
def _commit(root, step: int, world: int) -> None:
    """Write the job's checkpoint of ``step`` through the daemon's own commit path."""
    attempt = "0123456789ab-1"
    tmp = tmp_dir(root, step, attempt)
    tmp.mkdir(parents=True)

    def items(rank: int) -> list[PlannedItem]:
        sd = cj.sharded(cj.rank_state(rank, world, step), rank, world, step)
        planned = [i for k in ("w", "b", "big") for i in plan_tensor_items(sd[k], rank)]
        if rank == 0:
            planned += plan_tensor_items(sd["e"], rank)
        return planned + [plan_object(sd["o"], rank)]

    records = write_rank_files(tmp, map(items, range(world)), fsync=False)
    files = {data_file_name(rank): (rank, (tmp / data_file_name(rank)).stat().st_size) for rank in range(world)}
    commit_step(
        root,
        step,
        attempt,
        records,
        serialize_common({"iteration": step}),
        files,
        fsync=False,
        keep_last=0,
        megatron_tracker=False,
    )


def _events(steps: list[int], world: int) -> list[cj.Event]:
    return [cj.Event("run", r, "committed", s) for s in steps for r in range(world)]


@pytest.mark.timeout(60)
def test_checker_reports_corruption_and_lost_commits(tmp_path):
    world = 2
    spec = cj.JobSpec(str(tmp_path / "ckpts"), str(tmp_path), world, 2, {})
    root = tmp_path / "ckpts"
    for step in range(1, 6):
        _commit(root, step, world)

    def check(steps: list[int]) -> ct.TrialResult:
        result = ct.TrialResult(0, "rank")
        ct.check_root(spec, _events(steps, world), result)
        return result

    sound = check([1, 2, 3, 4, 5])
    assert (sound.corrupt, sound.lost_committed, sound.commits) == ([], [], 5)
    # A reported commit whose checkpoint vanished (not by retention: too few newer ones) is lost.
    shutil.rmtree(root / "iter_0000004")
    lost = check([1, 2, 3, 4, 5])
    assert lost.lost_committed and "step 4" in lost.lost_committed[0] and not lost.corrupt
    # A reported commit newer than the tracker's is lost too.
    (root / "latest").write_text("iter_0000003\n")
    behind = check([1, 2, 3, 5])
    assert any("older than the committed step 5" in m for m in behind.lost_committed)
    (root / "latest").write_text("iter_0000005\n")
    # One flipped bit in a data file, or a partial checkpoint under a final name, is corruption.
    data = root / "iter_0000005" / "__1_0.distcp"
    flip_bit(data, data.stat().st_size // 2)
    (root / "iter_0000006").mkdir()
    (root / "iter_0000006" / "__0_0.distcp").write_bytes(zlib.compress(b"partial"))
    bad = check([1, 2, 3, 5])
    assert any("ckptd verify exited 1" in m and "iter_0000005" in m for m in bad.corrupt), bad.corrupt
    assert any("iter_0000006" in m and "commit marker" in m for m in bad.corrupt), bad.corrupt
