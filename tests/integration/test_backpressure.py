"""Backpressure behind a slow disk (issue 25, M1-M3): on_full="skip" skips only a save the busy
ring has no room for, a skip on one rank resolves as SKIPPED on every rank and never fails a
later save, and fork snapshot children do not pile up waiting for ring space. Real daemons (slowed
by ``debug_write_delay_s``), real processes, real /dev/shm rings and files."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import psutil
import pytest
import torch

import ckptd
from ckptd import SaveSkippedError, ShardedTensor
from ckptd.format.rootlayout import step_dir_name
from tools.harness.ranks import run_ranks
from tools.harness.waiting import wait_until


def _config(runtime: str | Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime), idle_exit_s=2.0, heartbeat_s=0.2, **kw)


def _state(tensors: dict[str, torch.Tensor], step: int) -> dict:
    return {**{k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}, "iteration": step}


def _live_children(besides: frozenset[int] = frozenset()) -> list[int]:
    """This process's children that run, but those in ``besides`` (processes of the test session,
    e.g. multiprocessing's resource tracker): snapshot children (the daemon is detached)."""
    out = []
    for c in psutil.Process().children():
        try:
            if c.pid not in besides and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.timeout(180)
def test_skip_takes_any_save_on_an_idle_ring_and_skips_only_behind_a_busy_one(tmp_path, runtime_dir, single_process):
    """M2: a ring smaller than the save (budget 0.5x), and a state grown to 3x the first save,
    stream through an idle ring; only a save that finds earlier saves still holding the ring is
    skipped. Before: every such save was skipped, forever, on an idle disk too."""
    cfg = _config(runtime_dir, staging_budget="0.5x", on_full="skip", debug_write_delay_s=1.0)
    w = torch.randn(1024, 1024)  # 4 MiB: a 2 MiB ring
    grown = {"w": w, "exp_avg": torch.randn(1024, 1024), "exp_avg_sq": torch.rand(1024, 1024)}
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        h1 = ckpt.save(_state({"w": w}, 1), step=1)
        assert not h1.skipped
        h1.wait(timeout_s=60)
        h2 = ckpt.save(_state(grown, 2), step=2)  # optimizer state created after the first save
        assert not h2.skipped
        h2.wait(timeout_s=60)
        h3 = ckpt.save(_state(grown, 3), step=3)  # streams; its file opens 1 s later
        h4 = ckpt.save(_state(grown, 4), step=4)  # the ring still holds step 3: skipped
        assert h4.skipped and not h3.skipped
        h3.wait(timeout_s=60)
        assert ckpt.stats()["skipped"] == 1
        out = ckpt.load(_state({k: torch.zeros_like(v) for k, v in grown.items()}, -1), step=3)
        assert all(torch.equal(out[k], v) for k, v in grown.items())
        assert torch.equal(ckpt.load(_state({"w": torch.zeros_like(w)}, -1), step=1)["w"], w)
        assert ckpt.latest() == 3 and not (tmp_path / "run" / step_dir_name(4)).exists()


@pytest.mark.timeout(180)
def test_fork_children_do_not_pile_up_behind_a_slow_disk(tmp_path, runtime_dir, single_process):
    """M3: with fork snapshots and on_full="wait", each save's child used to wait for ring space
    holding its copy-on-write view of the trainer (one per save, up to 32 per rank). Now at most
    one child waits; a further save waits inside save() (counted in queue_wait_s) until that
    child has its room, so the live children stay at one waiting plus those still copying."""
    cfg = _config(runtime_dir, staging_budget="1x", on_full="wait", snapshot="auto", debug_write_delay_s=1.0)
    w = torch.zeros(1024, 1024)  # 4 MiB: each save fills the ring
    live, handles = [], []
    others = frozenset(_live_children())
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        for step in range(1, 9):
            w.fill_(float(step))
            handles.append(ckpt.save(_state({"w": w}, step), step=step))
            live.append(len(_live_children(others)))
        ckpt.wait_all(timeout_s=120)
        assert all(h.committed for h in handles)
        assert torch.equal(ckpt.load(_state({"w": torch.zeros_like(w)}, -1), step=8)["w"], torch.full_like(w, 8.0))
    # Before: [1, 1, 2, 3, 4, 5, 6, 7] (every child after the second waited for ring space).
    assert max(live) <= 3, live
    # The wait moved into save() from the third save on: the ring still held the save before.
    assert all(h.record.queue_wait_s > 0 for h in handles[2:]), [h.record.queue_wait_s for h in handles]
    wait_until(lambda: not _live_children(others), 30, "every snapshot child to exit")


@pytest.mark.timeout(180)
def test_a_snapshot_child_stalled_past_the_timeout_is_killed_before_later_saves_reuse_its_space(
    tmp_path, runtime_dir, single_process, monkeypatch
):
    """Step 1's snapshot child stops (SIGSTOP: as a child throttled or swapped out) before copying.
    Its save fails after ``snapshot_timeout_s``; the daemon then freed its ring space while the
    child lived, and later saves reused it: the child, resumed, would have copied step 1's bytes
    into their checkpoints. Now the daemon kills it first, and step 2 commits its own bytes."""
    from ckptd.staging import fork

    stall, stalled = tmp_path / "stall", tmp_path / "stalled-pid"
    real = fork._child

    def child(*args, **kwargs):  # runs in the forked child (the patch is in its copy of the parent)
        if stall.exists():
            stalled.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        real(*args, **kwargs)

    monkeypatch.setattr(fork, "_child", child)
    cfg = _config(runtime_dir, staging_budget="1x", snapshot="auto", snapshot_timeout_s=1.0)
    w = torch.zeros(1024, 1024)  # 4 MiB: each save fills the ring
    try:
        with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
            stall.touch()
            w.fill_(1.0)
            h1 = ckpt.save(_state({"w": w}, 1), step=1)
            # The child may start checking only after save() returned (a loaded machine).
            wait_until(stalled.exists, 30, "the snapshot child to stop itself")
            stall.unlink()
            with pytest.raises(ckptd.SaveFailedError, match="did not finish copying within 1 s"):
                h1.wait(timeout_s=60)
            pid = int(stalled.read_text())
            wait_until(lambda: _gone(pid), 30, f"the daemon to kill the stalled snapshot child {pid}")
            w.fill_(2.0)
            ckpt.save(_state({"w": w}, 2), step=2).wait(timeout_s=60)
            loaded = ckpt.load(_state({"w": torch.zeros_like(w)}, -1), step=2)["w"]
            assert torch.equal(loaded, torch.full_like(w, 2.0))
    finally:  # a stopped child left behind would hold the test runner's pipes open
        if stalled.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stalled.read_text()), signal.SIGKILL)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _skip_on_one_rank(rank: int, world: int, root: str, runtime: str) -> dict:
    import torch.distributed as dist

    # Rank 1's state fills its ring (1x): while its step 1 is being written (each file opens 5 s
    # late), it has no room for steps 2 and 3 and skips them. Rank 0's ring (1 MiB at least)
    # holds many of its small saves: it saves them, step 2 after rank 1 skipped it (its SAVE
    # comes after the abort), step 3 before (the abort comes after its SAVE).
    cfg = _config(runtime, staging_budget="1x", on_full="skip", debug_write_delay_s=5.0, commit_timeout_s=300)
    w = torch.full((1024, 1024), 1.0) if rank == 1 else torch.full((16, 16), 0.0)
    out: dict = {}
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        h1 = ckpt.save(_state({f"w{rank}": w}, 1), step=1)
        h2 = ckpt.save(_state({f"w{rank}": w}, 2), step=2) if rank == 1 else None
        dist.barrier()
        if rank == 0:
            h2 = ckpt.save(_state({f"w{rank}": w}, 2), step=2)
            h3 = ckpt.save(_state({f"w{rank}": w}, 3), step=3)
        dist.barrier()
        if rank == 1:
            h3 = ckpt.save(_state({f"w{rank}": w}, 3), step=3)
        assert h2 is not None
        out["skipped_here"] = [h.step for h in (h2, h3) if h.done() and h.skipped]
        for h in (h2, h3):  # resolved long before commit_timeout_s, without anyone waiting on them
            wait_until(h.done, 60, f"rank {rank}'s save of step {h.step} to resolve")
        out["status"] = [h2.status.value, h3.status.value]
        out["errors"] = [str(h2.error), str(h3.error)]
        h1.wait(timeout_s=60)
        dist.barrier()
        w.add_(10.0)
        h4 = ckpt.save(_state({f"w{rank}": w}, 4), step=4)  # before: rank 0 raised step 2's abort here
        out["h4"] = str(h4.wait(timeout_s=60))
        for h in (h2, h3):
            with pytest.raises(SaveSkippedError, match="rank 1"):
                h.wait()
        ckpt.wait_all(timeout_s=10)  # a skipped save is no failure
        out["stats"] = {k: ckpt.stats()[k] for k in ("committed", "aborted", "skipped")}
    return out


@pytest.mark.timeout(240)
def test_a_skip_on_one_rank_is_a_skip_on_every_rank_and_fails_no_later_save(tmp_path, runtime_dir):
    """M1: rank 1 skips steps 2 and 3 (its ring busy), rank 0 saved them. Rank 0's handles
    resolve at once as SKIPPED, naming rank 1 (before: ABORTED, raised by its next save(), which
    then did not save its own step, so rank 1's save of that step waited commit_timeout_s and
    aborted)."""
    root = tmp_path / "run"
    out = run_ranks(_skip_on_one_rank, 2, str(root), str(runtime_dir), timeout_s=200)
    assert out[1]["skipped_here"] == [2, 3]  # the skipping rank's own handles, at save()
    for o in out:
        assert o["status"] == ["skipped", "skipped"], o
        assert o["h4"] == str(root / step_dir_name(4))
        assert o["stats"] == {"committed": 2, "aborted": 0, "skipped": 2}
    assert all("rank 1" in e and "on_full='skip'" in e for e in out[0]["errors"]), out[0]["errors"]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == [
        step_dir_name(1),
        step_dir_name(4),
    ]
    out4 = ckptd.load_plain_tensors(root / step_dir_name(4))
    assert torch.equal(out4["w0"], torch.full((16, 16), 10.0))
    assert torch.equal(out4["w1"], torch.full((1024, 1024), 11.0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("snapshot", ["auto", "copy", "lazy"])
def test_an_item_as_large_as_the_ring_after_padding_streams_through_it(tmp_path, runtime_dir, single_process, snapshot):
    """An item a few bytes short of the ring's capacity, placed after the padding that aligns it
    (behind a 12-byte item), was never split, and its producer waited for room up to the padding
    while the daemon freed none until the item was produced: each waited for the other until
    ``snapshot_timeout_s`` failed the save, and every save of that state did the same."""
    small, big = torch.arange(3, dtype=torch.float32), torch.randn((1 << 20) // 4 - 4)  # 1 MiB ring
    cfg = _config(runtime_dir, staging_budget="1MiB", snapshot=snapshot, snapshot_timeout_s=8.0)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        for step in (10, 20):  # the second save starts behind the first one's padding too
            handle = ckpt.save(_state({"a": small, "b": big + step}, step), step=step)
            ckpt.before_update()
            handle.wait(timeout_s=60)
            assert handle.status is ckptd.SaveStatus.COMMITTED
        a, b = torch.zeros_like(small), torch.zeros_like(big)
        ckpt.load(_state({"a": a, "b": b}, -1), step=20)
    assert torch.equal(a, small) and torch.equal(b, big + 20)
