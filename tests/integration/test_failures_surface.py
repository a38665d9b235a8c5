"""A save's failure reaches the caller, and a failing save holds nobody up: close() and wait_all()
raise what they waited for, a wait with a timeout returns at it, a rank that cannot send its SAVE
aborts the step on every rank at once, and a SAVE the daemon refused gives its ring range back
without waiting for the snapshot child. A real daemon, real files, one process (two ranks where
the test needs them, each a Checkpointer of its own).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import SaveFailedError, SaveTimeoutError, ShardedTensor
from ckptd.control.endpoints import JobEnv
from ckptd.control.protocol import Bye
from ckptd.errors import StagingError
from ckptd.staging import lazy
from tools.harness.waiting import wait_until


def _config(runtime_dir: Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, **kw)


@pytest.mark.timeout(120)
def test_close_raises_the_failure_of_a_save_it_waited_for(tmp_path, single_process, runtime_dir):
    """close() (and leaving a ``with`` block) waits for the pending saves; one that fails then had
    been seen by nobody, yet close() returned normally (its own wait had marked it seen)."""
    cfg = _config(runtime_dir, snapshot="lazy")
    w = torch.randn(1000)
    with (
        pytest.raises(SaveFailedError, match="step 1 was not committed.*abandoned its snapshot"),
        ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt,
    ):
        ckpt.save({"w": w}, step=1)
        w.add_(1.0)  # before the fence: the lazy snapshot is torn, the step fails
    ckpt = ckptd.Checkpointer(tmp_path / "run", config=cfg)
    ckpt.save({"w": w}, step=2)
    w.add_(1.0)
    with pytest.raises(SaveFailedError, match="step 2 was not committed"):
        ckpt.close()


@pytest.mark.timeout(120)
def test_close_raises_the_save_failure_when_its_teardown_fails_too(tmp_path, single_process, runtime_dir, monkeypatch):
    """A teardown step raising (here, stopping the producers) replaced the save's failure that
    close() was about to raise: the caller learnt of the teardown only."""
    from ckptd.client.checkpointer import Checkpointer

    stop = Checkpointer._stop_producers

    def failing(self, deadline):
        stop(self, deadline)
        raise OSError("injected: the teardown failed")

    monkeypatch.setattr(Checkpointer, "_stop_producers", failing)
    w = torch.randn(1000)
    ckpt = ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, snapshot="lazy"))
    ckpt.save({"w": w}, step=1)
    w.add_(1.0)  # before the fence: the step fails
    with pytest.raises(SaveFailedError, match="step 1 was not committed"):
        ckpt.close()
    ckpt = ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir))
    with pytest.raises(OSError, match="injected"):  # nothing else to raise: the teardown's error is
        ckpt.close()


@pytest.mark.timeout(120)
def test_wait_all_raises_a_failure_that_arrived_before_it_waited(tmp_path, single_process, runtime_dir):
    """The step's abort came in while training went on: wait_all() delivered it first, which took
    the handle out of the pending saves before it was waited for, and returned normally."""
    w = torch.randn(1000)
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, snapshot="lazy")) as ckpt:
        ckpt.save({"w": w}, step=1)
        w.add_(1.0)
        ckpt.before_update()  # the fence abandons the snapshot; the daemon's STEP_ABORTED follows
        time.sleep(1.0)  # training goes on meanwhile
        with pytest.raises(SaveFailedError, match="step 1 was not committed"):
            ckpt.wait_all(timeout_s=60)
        ckpt.save({"w": w}, step=2).wait(timeout_s=60)  # nothing left to raise


@pytest.mark.timeout(120)
def test_a_wait_with_a_timeout_returns_at_it_while_a_lazy_copy_waits(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    """The fence inside handle.wait(timeout_s) waited snapshot_timeout_s for a lazy copy waiting
    for ring room (the daemon stalled), then raised StagingError; it returns SaveTimeoutError at
    the caller's timeout, and the save commits once the daemon goes on."""
    cfg = _config(runtime_dir, snapshot="lazy", staging_budget="0.25x", snapshot_timeout_s=60)
    state = {"w": torch.randn(1_000_000), "b": torch.randn(10)}  # streams through a quarter-size ring
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        daemon = ckpt._link.daemon_pid
        assert daemon is not None
        after_ack = lazy.LazyProducer.after_ack

        def stall_daemon(producer):  # a daemon stuck behind a slow disk, right after it took the save
            os.kill(daemon, signal.SIGSTOP)
            return after_ack(producer)

        monkeypatch.setattr(lazy.LazyProducer, "after_ack", stall_daemon)
        try:
            handle = ckpt.save(state, step=1)
            monkeypatch.setattr(lazy.LazyProducer, "after_ack", after_ack)
            t0 = time.monotonic()
            with pytest.raises(SaveTimeoutError, match="did not commit within the wait timeout"):
                handle.wait(timeout_s=1.0)
            assert time.monotonic() - t0 < 30  # not snapshot_timeout_s
        finally:
            os.kill(daemon, signal.SIGCONT)
        assert handle.wait(timeout_s=60) == tmp_path / "run" / "iter_0000001"


@pytest.mark.timeout(180)
def test_a_refused_save_does_not_wait_for_its_snapshot_child(tmp_path, single_process, runtime_dir):
    """A SAVE the daemon refused (here: it had forgotten the connection, which save() recovers
    from) waited in save() until its fork child, waiting for ring room the daemon never frees,
    gave up after snapshot_timeout_s. The child is killed now, and the save goes again at once."""
    cfg = _config(runtime_dir, staging_budget="0.25x", snapshot_timeout_s=90)
    state = {"w": torch.randn(1_000_000), "b": torch.randn(10)}  # 4 MB through a 1 MB ring
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.save(state, step=1).wait(timeout_s=60)
        ckpt._link.send(Bye())  # the daemon forgets this connection: the next SAVE is refused
        wait_until(lambda: not ckpt.status()["rings"], 30, "the daemon to retire the rank's ring")
        t0 = time.monotonic()
        handle = ckpt.save(state, step=2)
        assert time.monotonic() - t0 < 45  # not snapshot_timeout_s
        handle.wait(timeout_s=60)
        out = ckpt.load({"w": torch.zeros(1_000_000), "b": torch.zeros(10)}, step=2)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


def _ranks(tmp_path: Path, runtime_dir: Path, **kw) -> list[ckptd.Checkpointer]:
    cfg = _config(runtime_dir, snapshot="copy", commit_timeout_s=120, run_id="failing", **kw)
    return [
        ckptd.Checkpointer(
            tmp_path / "run", config=cfg, env=JobEnv(rank=r, local_rank=r, world_size=2, local_world_size=2)
        )
        for r in range(2)
    ]


def _state(rank: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(rank)), (0, rank, 2))}


@pytest.mark.timeout(120)
def test_a_rank_that_cannot_send_its_save_aborts_the_step_on_every_rank(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    """A failure between planning and the SAVE (here /dev/shm full) sent nothing: the other ranks'
    saves of the step waited out commit_timeout_s, and this rank's attempt counter fell behind
    theirs, so a retry of the step could never commit."""
    c0, c1 = _ranks(tmp_path, runtime_dir)
    try:
        c1.prepare(_state(1))
        ring = c1._ring.current
        assert ring is not None

        def full(*_):
            raise StagingError("/dev/shm is full (simulated)")

        monkeypatch.setattr(ring, "check_room", full)
        h0 = c0.save(_state(0), step=1)
        with pytest.raises(StagingError, match="simulated"):
            c1.save(_state(1), step=1)
        with pytest.raises(SaveFailedError, match="rank 1 could not save step 1: /dev/shm is full"):
            h0.wait(timeout_s=60)  # at once, not after commit_timeout_s
        monkeypatch.undo()
        retry = [c.save(_state(r), step=1) for r, c in enumerate((c0, c1))]
        assert retry[0].attempt == retry[1].attempt
        assert all(h.wait(timeout_s=60) == tmp_path / "run" / "iter_0000001" for h in retry)
    finally:
        for c in (c0, c1):
            c.close(wait=False)


@pytest.mark.timeout(120)
def test_an_earlier_failure_raised_by_save_aborts_no_later_step(tmp_path, single_process, monkeypatch, runtime_dir):
    """save() raises an earlier save's failure nobody observed; that is no failure of its own step:
    it tells nobody and counts no try, so the other ranks' saves of the step go on and a retry of
    it pairs with theirs (a SKIP there aborted the step on every rank, whose next save() then
    raised that abort in turn, step after step)."""
    from ckptd.errors import CkptdError

    c0, c1 = _ranks(tmp_path, runtime_dir)
    try:

        def bad_state(*_):
            raise CkptdError("bad state dict (simulated)")

        monkeypatch.setattr(c1._planner, "plan", bad_state)
        first = c0.save(_state(0), step=1)
        with pytest.raises(CkptdError, match="simulated"):
            c1.save(_state(1), step=1)
        monkeypatch.undo()
        wait_until(first.done, 60, "rank 0's save of step 1 to be aborted")
        with pytest.raises(SaveFailedError, match="earlier asynchronous save"):
            c0.save(_state(0), step=2)
        h1 = c1.save(_state(1), step=2)
        h0 = c0.save(_state(0), step=2)  # the retry
        assert h0.attempt == h1.attempt
        assert all(h.wait(timeout_s=60) == tmp_path / "run" / "iter_0000002" for h in (h0, h1))
    finally:
        for c in (c0, c1):
            c.close(wait=False)


@pytest.mark.timeout(120)
def test_waiting_for_a_save_does_not_wait_for_a_later_lazy_copy(tmp_path, single_process, monkeypatch, runtime_dir):
    """handle.wait(timeout_s) of a save that committed meanwhile fenced every pending lazy snapshot,
    a later save's slow copy included, for the whole timeout, then raised SaveTimeoutError."""
    w = torch.randn(1000)
    with ckptd.Checkpointer(tmp_path / "run", config=_config(runtime_dir, snapshot="lazy")) as ckpt:
        first = ckpt.save({"w": w}, step=1)
        copy = lazy.LazyCopier._copy

        def slow(copier, job):  # a large copy of step 2 behind training
            if job.step == 2:
                time.sleep(6)
            return copy(copier, job)

        monkeypatch.setattr(lazy.LazyCopier, "_copy", slow)
        later = ckpt.save({"w": w}, step=2)  # fences step 1, which commits meanwhile
        wait_until(lambda: (tmp_path / "run" / "iter_0000001").is_dir(), 30, "step 1 to commit")
        t0 = time.monotonic()
        assert first.wait(timeout_s=3.0) == tmp_path / "run" / "iter_0000001"
        assert time.monotonic() - t0 < 3.0
        assert later.wait(timeout_s=60) == tmp_path / "run" / "iter_0000002"
