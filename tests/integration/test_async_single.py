"""A single process without torch.distributed: backpressure (skip, wait), retention, ring growth,
and an auto-started daemon that exits by itself and leaves nothing behind. Real daemon, real files.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import ckptd
from ckptd import ShardedObject, ShardedTensor
from ckptd.control.endpoints import JobEnv
from ckptd.errors import StagingError
from ckptd.format.dcp_metadata import read_index
from tools.harness.waiting import wait_for_exit


def _sd(w: torch.Tensor, step: int) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "meta": ShardedObject("meta", {"s": step}, (1,), (0,)),
        "iteration": step,
    }


def _loaded(ckpt: ckptd.Checkpointer, shape: tuple[int, ...], step: int | None = None) -> dict:
    return ckpt.load(_sd(torch.zeros(shape), -1), step=step)


@pytest.mark.timeout(120)
def test_single_process_backpressure_retention_and_clean_exit(tmp_path, single_process, runtime_dir):
    assert JobEnv.detect() == JobEnv()
    root = tmp_path / "run"
    cfg = ckptd.CkptdConfig.from_env(
        {},
        runtime_dir=str(runtime_dir),
        staging_budget="1x",
        on_full="skip",
        keep_last=2,
        debug_write_delay_s=0.5,
        idle_exit_s=3.0,
        heartbeat_s=0.2,
    )
    w = torch.randn(512, 1024)  # 2 MiB: one save fills the ring (staging_budget 1x)
    ref = {}
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        daemon_pid = ckpt.status()["pid"]
        ref[1] = w.clone()
        h1 = ckpt.save(_sd(w, 1), step=1)
        w.add_(1)
        h2 = ckpt.save(_sd(w, 2), step=2)  # the ring still holds step 1, being written: skipped
        assert h2.skipped and h2.done()
        with pytest.raises(ckptd.SaveSkippedError, match="staging ring of rank 0 had no room for it"):
            h2.wait()
        assert h1.wait(timeout_s=30) == root / "iter_0000001"
        assert ckpt.latest() == 1 and not list(root.glob("iter_0000002.*tmp"))
        with pytest.raises(ckptd.CheckpointExistsError):
            ckpt.save(_sd(w, 1), step=1)

    # on_full="wait": back-to-back saves stream through the ring behind each other, all commit, in order.
    # (Staged by the trainer itself: snapshot="copy"; the other tests fork.)
    with ckptd.Checkpointer(root, config=cfg.replace(on_full="wait", snapshot="copy")) as ckpt:
        handles = []
        for step in (3, 4, 5):
            w.add_(1)
            ref[step] = w.clone()
            handles.append(ckpt.save(_sd(w, step), step=step))
            w.fill_(float("nan"))  # training overwrites everything right away
            w.copy_(ref[step])
        ckpt.wait_all(timeout_s=60)
        assert [h.committed for h in handles] == [True] * 3
        assert ckpt.latest() == 5
        for step in (4, 5):
            out = _loaded(ckpt, (512, 1024), step)
            assert torch.equal(out["w"], ref[step]) and out["meta"] == {"s": step} and out["iteration"] == step
        # Retention (keep_last=2) removed the older ones only after newer ones had committed.
        assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000005"]
        # A bigger state than the ring was sized for: it streams through the ring (the tensor
        # stored as several chunks), and commits.
        big = torch.randn(1024, 1536)
        ckpt.save(_sd(big, 6), step=6).wait(timeout_s=30)
        assert torch.equal(_loaded(ckpt, (1024, 1536))["w"], big)
        assert len(read_index(root / "iter_0000006").tensors["w"].chunks) > 1
        assert ckpt.status()["pid"] == daemon_pid  # one daemon served both Checkpointers

    # The auto-started daemon exits once idle; nothing is left behind.
    wait_for_exit(daemon_pid, 30, "the idle daemon to exit")
    left = [n for n in os.listdir("/dev/shm") if n.startswith("ckptd-")]
    assert not [n for n in left if ckpt.endpoints.job in n]
    assert sorted(os.listdir(runtime_dir)) == sorted([f"{ckpt.endpoints.job}.token", f"{ckpt.endpoints.stem}.log"])
    assert (root / "latest").read_text().strip() == "iter_0000006"


@pytest.mark.timeout(120)
def test_unchanged_structure_sends_only_the_layout_id(tmp_path, monkeypatch, single_process, runtime_dir):
    """Saves of the same structure send the item list once; a changed structure sends it again;
    a layout the daemon does not hold is refused with a clear error and the next save recovers."""
    # A refused SAVE must give its ring space back, or the next save would wait forever.
    cfg = ckptd.CkptdConfig.from_env(
        {},
        runtime_dir=str(runtime_dir),
        idle_exit_s=2.0,
        heartbeat_s=0.2,
        staging_budget="1x",
        in_flight_wait_timeout_s=20,
        snapshot_timeout_s=20,
    )
    sent: list[int] = []
    tensors = {f"t{i}": torch.randn(3, 5) for i in range(50)}

    def state(ts: dict, step: int) -> dict:
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in ts.items()} | {"iteration": step}

    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        items_for = ckpt._layout.items_for

        def spy(*args):
            wire, layout, held = items_for(*args)
            sent.append(len(wire))
            return wire, layout, held

        monkeypatch.setattr(ckpt._layout, "items_for", spy)
        ref = {}
        for step in (1, 2, 3):
            for t in tensors.values():
                t.add_(1)
            ref[step] = {k: v.clone() for k, v in tensors.items()}
            ckpt.save(state(tensors, step), step=step)
        ckpt.wait_all(timeout_s=60)
        assert sent == [50, 0, 0]
        for step in (2, 3):
            out = ckpt.load(state({k: torch.zeros(3, 5) for k in tensors}, -1), step=step)
            assert all(torch.equal(out[k], ref[step][k]) for k in tensors)

        ckpt._layout.layout_id = "not-sent"  # the daemon never saw this id
        with pytest.raises(ckptd.CkptdError, match="does not hold"):
            ckpt.save(state(tensors, 4), step=4)
        ckpt.save(state(tensors, 5), step=5).wait(timeout_s=30)  # sent in full again
        tensors["extra"] = torch.arange(7.0)
        ckpt.save(state(tensors, 6), step=6).wait(timeout_s=30)
        assert sent[3:] == [0, 50, 51]
        out = ckpt.load(state({k: torch.zeros_like(v) for k, v in tensors.items()}, -1), step=6)
        assert all(torch.equal(out[k], tensors[k]) for k in tensors)
        assert ckpt.latest() == 6


@pytest.mark.timeout(120)
def test_a_failed_copy_names_the_item_and_gives_its_space_back(tmp_path, single_process, monkeypatch, runtime_dir):
    """save() raises a StagingError naming key and rank when a shard cannot be copied; the save
    is abandoned and its ring space is free again (a ring of one save: otherwise the next save
    would wait until it times out). The failure is injected into the copy of one tensor, as a
    failing device copy would raise."""
    from ckptd.staging.rankside import StagingRing

    refused = torch.ones(2, 4).t()
    real_write = StagingRing._write_tensor

    def write_tensor(self, src, v):
        if src.data_ptr() == refused.data_ptr():
            raise RuntimeError("copy refused by the device")
        return real_write(self, src, v)

    monkeypatch.setattr(StagingRing, "_write_tensor", write_tensor)
    cfg = ckptd.CkptdConfig.from_env(
        {},
        runtime_dir=str(runtime_dir),
        idle_exit_s=2.0,
        heartbeat_s=0.2,
        staging_budget="1x",
        in_flight_wait_timeout_s=5,
        snapshot_timeout_s=10,
        snapshot="copy",
    )
    w = torch.randn(512, 1024)
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        for step in (1, 2):  # twice: lost space would make the second save wait, then fail
            bad = {"w": ShardedTensor.from_rank_offsets("w", w), "x": ShardedTensor.from_rank_offsets("x", refused)}
            with pytest.raises(
                StagingError,
                match=r"copying 'x' chunk at offsets \(0, 0\) \(rank 0\) "
                r"into the staging ring failed: .*copy refused",
            ):
                ckpt.save(bad, step=step)
        assert ckpt.save(_sd(w, 3), step=3).wait(timeout_s=30) == tmp_path / "run" / "iter_0000003"
        assert torch.equal(_loaded(ckpt, (512, 1024))["w"], w) and ckpt.latest() == 3


@pytest.mark.timeout(120)
def test_a_snapshot_child_stuck_in_fork_is_replaced_and_the_save_commits(
    tmp_path, single_process, monkeypatch, runtime_dir
):
    """The child of a fork snapshot can deadlock inside ``os.fork()`` on Python < 3.12 (CPython
    gh-112275) before it copies anything. Simulated here for the first fork: save() kills it and
    forks again while the trainer's memory is still as it was, so the save commits with the
    values of the save() call (the tensor changes right after it returns). Before, the save
    failed after snapshot_timeout_s."""
    real_fork = os.fork
    forks: list[int] = []

    def fork() -> int:
        pid = real_fork()
        if pid == 0 and not forks:
            time.sleep(60)  # stuck in "os.fork()": save() kills it long before
            os._exit(1)
        forks.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", fork)
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, snapshot_timeout_s=10)
    w = torch.randn(256, 1024)
    expected = w.clone()
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        h = ckpt.save(_sd(w, 1), step=1)
        w.add_(1.0)  # training goes on at once
        assert h.wait(timeout_s=30) == tmp_path / "run" / "iter_0000001"
        assert len(forks) == 2  # the stuck child, then the one that copied
        assert torch.equal(_loaded(ckpt, (256, 1024))["w"], expected)


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:ComplexHalf support is experimental")
def test_every_dtype_torch_dcp_saves_persists_asynchronously_bit_exact(tmp_path, single_process, runtime_dir):
    """float8 variants, complex32, float4, uint64...: staged into the slot (by the fork child, and
    by the trainer's copy for non-contiguous views), written by the daemon, loaded bit-exact and
    verified deep."""
    from ckptd.verify import verify_checkpoint
    from tests.dtypes import dcp_dtypes, dtype_label, random_tensor, same_bits

    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2)
    ref = {dtype_label(dt): random_tensor(dt, i, (8, 6)) for i, dt in enumerate(dcp_dtypes(tmp_path / "probe"))}
    # Step 1: contiguous tensors (the fork child copies them). Step 2: transposed views, which
    # the trainer copies into typed views of the slot.
    states = {1: dict(ref.items()), 2: {k: v.t() for k, v in ref.items()}}
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        for step, tensors in states.items():
            ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, step=step)
        ckpt.wait_all(timeout_s=60)
        for step, tensors in states.items():
            out = ckpt.load(
                {
                    k: ShardedTensor.from_rank_offsets(k, torch.empty(v.shape, dtype=v.dtype))
                    for k, v in tensors.items()
                },
                step=step,
            )
            assert [k for k, v in tensors.items() if not same_bits(out[k], v)] == [], step
            report = verify_checkpoint(tmp_path / "run" / f"iter_000000{step}", deep=True)
            assert report.ok and report.items_decoded == len(ref), report.findings


@pytest.mark.timeout(120)
def test_step_0_never_writes_0_into_megatron_lm_tracker(tmp_path, single_process, runtime_dir):
    """Megatron-LM's read_metadata refuses iteration 0 ("iteration > 0 or release"): after step 0
    its tracker is left as it was (absent here), ckptd's own `latest` names iter_0000000; step 5
    then updates both."""
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2)
    root = tmp_path / "run"
    tracker = root / "latest_checkpointed_iteration.txt"
    w = torch.randn(4, 3)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        ckpt.save(_sd(w, 0), step=0).wait(timeout_s=30)
        assert ckpt.latest() == 0 and (root / "latest").read_text().strip() == "iter_0000000"
        assert not tracker.exists()
        ckpt.save(_sd(w + 1, 5), step=5).wait(timeout_s=30)
        assert ckpt.latest() == 5 and tracker.read_text().strip() == "5"
        assert torch.equal(_loaded(ckpt, (4, 3), 0)["w"], w)
