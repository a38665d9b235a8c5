"""A relaunch settles what its crashed predecessor left with the node daemons (ckptd.client.settle):
it resumes the step the trainer handed off last, once the daemons committed it, and it has a step
that can never commit (a rank crashed inside ``save()``) aborted at once, so that its own save of
that step commits.

Real trainers (a process that exits right after ``save()`` returned, or ranks that close without
waiting), a real daemon that outlives them, real gloo ranks. The previous launch's data files hang
(a ``hang`` fault rule) until the relaunch is waiting, so the relaunch always finds step 10 in
flight; a step that cannot commit is being collected by the coordinator as the relaunch starts.
Before, the relaunch resumed step 5, and its save of step 10 was refused: as committed
already, or as a second attempt of a step whose first attempt was still collecting.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from tests.multiproc import without_torchrun
from tools.harness.ports import free_port
from tools.harness.ranks import run_ranks
from tools.harness.waiting import wait_until

HANG_DATA_FILES = "hang __*\n"


def _sd(w: torch.Tensor, rank: int = 0, world_size: int = 1) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world_size))}


def _values(step: int, rank: int = 0) -> torch.Tensor:
    return torch.arange(256, dtype=torch.float32) + step * 100 + rank * 0.5


class _ReleaseWhenWaiting(logging.Handler):
    """Removes the fault file once the resume says it waits: the held writes go on then."""

    def __init__(self, fault_file: Path) -> None:
        super().__init__()
        self.fault_file = fault_file
        self.waited = False

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("waiting up to"):
            self.waited = True
            self.fault_file.unlink(missing_ok=True)


def _resume(ckpt: ckptd.Checkpointer, sd: dict, fault_file: Path) -> tuple[dict | None, bool, float]:
    """``ckpt.resume(sd)`` with the fault file removed once it waits: the loaded state, whether it
    waited, and for how long it ran."""
    logger = logging.getLogger("ckptd.client.settle")
    handler, level = _ReleaseWhenWaiting(fault_file), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    t0 = time.monotonic()
    try:
        out = ckpt.resume(sd)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        fault_file.unlink(missing_ok=True)
    return out, handler.waited, time.monotonic() - t0


_CRASHES_AFTER_HANDING_OFF = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    import torch
    import ckptd
    from ckptd import ShardedTensor

    root, runtime, faults = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, debug_fault_file=str(faults), idle_exit_s=60.0)
    ckpt = ckptd.Checkpointer(root, config=cfg)
    for step in (5, 10):
        w = torch.arange(256, dtype=torch.float32) + step * 100
        h = ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=step)
        if step == 5:
            h.wait(timeout_s=60)
            faults.write_text(sys.argv[4])  # step 10's data file waits for the relaunch
    print("handed off", flush=True)
    os._exit(1)  # the trainer crashes; the daemon still writes and commits step 10
    """
)


@pytest.mark.timeout(120)
def test_a_relaunch_resumes_the_step_the_crashed_trainer_handed_off(tmp_path, single_process, runtime_dir):
    root, faults = tmp_path / "run", tmp_path / "faults"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHES_AFTER_HANDING_OFF, str(root), str(runtime_dir), str(faults), HANG_DATA_FILES],
        env=without_torchrun(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "handed off" in proc.stdout, proc.stdout + proc.stderr
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), resume_wait_s=60.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        out, waited, _ = _resume(ckpt, _sd(torch.zeros(256)), faults)
        assert waited and out is not None and torch.equal(out["w"], _values(10))
        assert ckpt.latest() == 10
        ckpt.save(_sd(_values(20)), step=20).wait(timeout_s=60)  # the relaunch trains on from step 10


def _as_node(rank: int, coordinator_port: int, **config: Any) -> ckptd.CkptdConfig:
    """This rank is node ``rank`` of its own (a node daemon each, the coordinator in node 0's, on
    one port for both launches: each launch has a MASTER_PORT of its own); its config."""
    os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
    return ckptd.CkptdConfig.from_env({}, coordinator_port=coordinator_port, **config)


def _launch(
    rank: int, world_size: int, root: str, runtime: str, faults: str, port: int, rank_1_hands_off: bool
) -> None:
    """Both ranks commit step 5, then rank 0 (and rank 1 if ``rank_1_hands_off``) hands step 10 to
    the daemon, and both go away without waiting for it. Step 10's data files hang until the
    relaunch waits, if every rank handed it off; else rank 0's is written and reported first (the
    coordinator collects the attempt)."""
    ckpt = _committed_step_5(rank, world_size, root, runtime, faults, port)
    if rank == 0 and rank_1_hands_off:
        Path(faults).write_text(HANG_DATA_FILES)
    if rank == 0 or rank_1_hands_off:
        h = ckpt.save(_sd(_values(10, rank), rank, world_size), step=10)
    if rank == 0 and not rank_1_hands_off:
        wait_until(lambda: _reported(ckpt, h.attempt, [0]), 30, "the coordinator to collect step 10")
    ckpt.close(wait=False)  # as a crash: the daemon keeps what was handed off; no failure of it is raised
    if rank == 0 or rank_1_hands_off:  # step 10's handle: unconfirmed, the daemon still commits it
        assert h.status is ckptd.SaveStatus.ABORTED, h
        assert str(h.error).startswith("step 10 was not confirmed: the Checkpointer was closed"), h.error
        assert "still commits it" in str(h.error), h.error


def _committed_step_5(
    rank: int, world_size: int, root: str, runtime: str, faults: str, port: int
) -> ckptd.Checkpointer:
    """The first launch's Checkpointer on node ``rank``, once step 5 committed."""
    cfg = _as_node(
        rank,
        port,
        runtime_dir=runtime,
        debug_fault_file=faults,
        # What a rank never handed off would abort only long after the relaunch saved step 10 again.
        commit_timeout_s=300.0,
        shutdown_grace_s=2.0,
        idle_exit_s=60.0,
    )
    ckpt = ckptd.Checkpointer(root, config=cfg)
    ckpt.save(_sd(_values(5, rank), rank, world_size), step=5).wait(timeout_s=60)
    return ckpt


def _reported(ckpt: ckptd.Checkpointer, attempt: str, ranks: list[int]) -> bool:
    """Whether the coordinator (node 0's daemon) collects step 10 with ``ranks`` reported."""
    return ckpt.status()["coordinator"]["steps"].get(f"10/{attempt}", {}).get("written") == ranks


def _relaunch(
    rank: int, world_size: int, root: str, runtime: str, faults: str, port: int
) -> tuple[int, bool, bool, int | None]:
    """Resume, then save step 10 (the next save of a job that resumed step 5; a no-op check of the
    one that resumed step 10): the step loaded, bit-exact or not, whether it waited, and what the
    save of step 10 gave (10: committed; None: skipped, the step was loaded)."""
    cfg = _as_node(rank, port, runtime_dir=runtime, resume_wait_s=60.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        assert ckpt.status()["node"] == rank  # its own node daemon
        out, waited, took_s = _resume(ckpt, _sd(torch.zeros(256), rank, world_size), Path(faults))
        assert out is not None and took_s < 30.0, took_s  # decided long before resume_wait_s (60 s)
        step = int(out["w"][0].item()) // 100
        saved = None
        if step < 10:
            ckpt.save(_sd(_values(10, rank), rank, world_size), step=10).wait(timeout_s=60)
            saved = ckpt.latest()
        return step, torch.equal(out["w"], _values(step, rank)), waited, saved


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rank_1_hands_off", [True, False], ids=["every-rank-handed-off", "rank-1-crashed-in-save"])
def test_a_relaunch_waits_for_a_step_every_rank_handed_off_and_aborts_one_that_cannot_commit(
    tmp_path, runtime_dir, rank_1_hands_off
):
    """Two nodes, a rank each: every rank asks its own node daemon, and only all answers together
    tell whether step 10 can still commit."""
    root, runtime, faults, port = str(tmp_path / "run"), str(runtime_dir), str(tmp_path / "faults"), free_port()
    run_ranks(_launch, 2, root, runtime, faults, port, rank_1_hands_off, timeout_s=60)
    outcomes = run_ranks(_relaunch, 2, root, runtime, faults, port, timeout_s=90)
    if rank_1_hands_off:  # (rank 0 logs the wait)
        assert outcomes == [(10, True, True, None), (10, True, False, None)], outcomes
    else:
        # Step 10 could never commit: it was aborted at once (the resume waited only for that
        # verdict), so the relaunch's own save of step 10 committed, not refused as a second
        # attempt of the step.
        assert outcomes == [(5, True, True, 10), (5, True, False, 10)], outcomes


@pytest.mark.timeout(120)
def test_a_resume_beside_a_running_launch_leaves_its_saves_alone(tmp_path, single_process, runtime_dir):
    """A second Checkpointer on the root (an evaluation's, say) resumes while the trainer's save of
    step 10 is in flight: it neither waits for that save nor has it aborted, and the daemon refuses
    an ABANDON of a save whose launch still runs."""
    from ckptd.client.settle import DaemonsInFlight

    root, faults = tmp_path / "run", tmp_path / "faults"
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), debug_fault_file=str(faults), resume_wait_s=60.0)
    with ckptd.Checkpointer(root, config=cfg) as trainer:
        trainer.save(_sd(_values(5)), step=5).wait(timeout_s=60)
        faults.write_text(HANG_DATA_FILES)
        h = trainer.save(_sd(_values(10)), step=10)
        with ckptd.Checkpointer(root, config=cfg) as reader:
            out, waited, _ = _resume(reader, _sd(torch.zeros(256)), faults)
            assert not waited and out is not None and torch.equal(out["w"], _values(5))
            faults.write_text(HANG_DATA_FILES)
            DaemonsInFlight(reader.root, 0, lambda: reader._link, lambda _: None).abandon([((10, h.attempt), (0,))])
        faults.unlink()
        assert h.wait(timeout_s=60) == root / "iter_0000010"


def _launch_losing_node_1(rank: int, world_size: int, root: str, runtime: str, faults: str, port: int) -> None:
    """Both ranks commit step 5 and hand step 10 off; node 1's daemon writes and reports rank 1's
    part, then dies (SIGKILL), while rank 0's data file hangs on node 0. Then the trainers go."""
    import signal

    import torch.distributed as dist

    ckpt = _committed_step_5(rank, world_size, root, runtime, faults, port)
    if rank == 0:
        Path(faults).write_text("hang __0_*\n")  # rank 0's data file only
    dist.barrier()
    h = ckpt.save(_sd(_values(10, rank), rank, world_size), step=10)
    pids = [0, 0]
    dist.all_gather_object(pids, ckpt.status()["pid"])
    if rank == 0:
        wait_until(lambda: _reported(ckpt, h.attempt, [1]), 30, "node 1 to report rank 1's part of step 10")
        os.kill(pids[1], signal.SIGKILL)
    dist.barrier()
    try:
        ckpt.close(wait=False)
    except ckptd.CkptdError as exc:  # step 10's handle, or node 1's lost daemon
        if "step 10" not in str(exc) and "died" not in str(exc):
            raise


@pytest.mark.timeout(240)
def test_a_save_a_dead_node_daemon_reported_is_kept_and_resumed(tmp_path, runtime_dir):
    """The relaunch finds only rank 0's part of step 10 (node 1's daemon reported rank 1's, then
    died): it asks to abandon it, the coordinator keeps it (its reports and the part found make up
    the world), and the relaunch waits for it to commit, then resumes it."""
    root, runtime, faults, port = str(tmp_path / "run"), str(runtime_dir), str(tmp_path / "faults"), free_port()
    run_ranks(_launch_losing_node_1, 2, root, runtime, faults, port, timeout_s=90)
    outcomes = run_ranks(_relaunch, 2, root, runtime, faults, port, timeout_s=90)
    assert outcomes == [(10, True, True, None), (10, True, False, None)], outcomes
