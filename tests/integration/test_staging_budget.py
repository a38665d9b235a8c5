"""Staging within a budget: saves stream through a ring of shared memory smaller than the state.

Two ranks on one node, a real daemon, real /dev/shm rings. With ``staging_budget="0.25x"`` each
rank's ring holds a quarter of its save: the producer (fork child, the trainer in copy mode, the
lazy copier) waits for the daemon to free space as it writes, tensors larger than the ring are
stored as several chunks, and every save commits bit-exact, read by ckptd and torch DCP. The
ring never takes more /dev/shm than the budget, whatever the number of saves.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import StagingError
from ckptd.format.dcp_metadata import read_index
from ckptd.format.rootlayout import step_dir_name
from ckptd.staging.ring import HEADER_NBYTES
from ckptd.staging.segment import SHM_DIR, allocated_nbytes, list_segments
from tools.harness.ranks import run_ranks

ROWS, COLS = 1024, 1024  # 4 MiB per rank and tensor; the state of a rank is 8 MiB


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"a": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(ROWS, COLS, generator=g)}


def _sharded(state: dict[str, torch.Tensor], rank: int, world: int, step: int) -> dict:
    return {**{k: ShardedTensor.from_rank_offsets(k, v, (0, rank, world)) for k, v in state.items()}, "iteration": step}


def _ring_shm_nbytes(prefix: str) -> int:
    """Pages of /dev/shm the rings of the job's node hold right now (both ranks')."""
    total = 0
    for name in list_segments(prefix):
        fd = os.open(SHM_DIR / name, os.O_RDONLY)
        try:
            total += allocated_nbytes(fd)
        finally:
            os.close(fd)
    return total


def _saves(rank: int, world: int, root: str, snapshot: str, budget: str) -> dict:
    cfg = ckptd.CkptdConfig.from_env(os.environ, snapshot=snapshot, staging_budget=budget)
    saved, peak_shm = {}, 0
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        if snapshot == "lazy":
            ckpt.before_update()  # nothing pending yet; fences below
        handles = []
        for step in (1, 2, 3):
            state = _state(rank, step)
            saved[step] = {k: v.clone() for k, v in state.items()}
            handles.append(ckpt.save(_sharded(state, rank, world, step), step=step))
            if snapshot == "lazy":
                ckpt.before_update()  # the optimizer step: waits for the copies, then changes state
            for t in state.values():
                t.fill_(float("nan"))  # training overwrites right after
            peak_shm = max(peak_shm, _ring_shm_nbytes(ckpt.endpoints.shm_prefix))
        for h in handles:
            h.wait(timeout_s=120)
            peak_shm = max(peak_shm, _ring_shm_nbytes(ckpt.endpoints.shm_prefix))
        ring_nbytes = ckpt.status()["rings"][0]["ring_nbytes"]
        for step in (1, 2, 3):
            want = {k: torch.zeros(ROWS, COLS) for k in ("a", "b")}
            out = ckpt.load(_sharded(want, rank, world, -1), step=step)
            assert all(torch.equal(out[k], saved[step][k]) for k in ("a", "b")), (rank, step)
            assert out["iteration"] == step
    return {"ring_nbytes": ring_nbytes, "peak_shm": peak_shm, "save_nbytes": 2 * ROWS * COLS * 4}


def _run(tmp_path: Path, runtime_dir: Path, snapshot: str, budget: str) -> tuple[Path, list[dict]]:
    root = tmp_path / "ckpts"
    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "2", "CKPTD_HEARTBEAT_S": "0.2"}
    return root, run_ranks(_saves, 2, str(root), snapshot, budget, env=env, timeout_s=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("snapshot", ["auto", "copy", "lazy"])
def test_a_quarter_budget_streams_every_save_and_commits_bit_exact(tmp_path, snapshot, runtime_dir):
    import torch.distributed.checkpoint as dcp

    root, out = _run(tmp_path, runtime_dir, snapshot, "0.25x")
    for o in out:
        assert o["ring_nbytes"] <= 0.25 * o["save_nbytes"] + 4096  # a quarter, in whole pages
        # The node's /dev/shm never holds more than its rings, whatever the number of saves.
        assert o["peak_shm"] <= sum(p["ring_nbytes"] + HEADER_NBYTES for p in out)
    for step in (1, 2, 3):
        d = root / step_dir_name(step)
        chunks = read_index(d).tensors["a"].chunks
        assert len(chunks) > 2  # 4 MiB shards through 2 MiB rings: stored as several chunks each
        full = {k: torch.cat([_state(r, step)[k] for r in (0, 1)]) for k in ("a", "b")}
        target = {k: torch.zeros(2 * ROWS, COLS) for k in ("a", "b")}
        dcp.load(target, checkpoint_id=str(d), no_dist=True)
        assert all(torch.equal(target[k], full[k]) for k in ("a", "b")), step
        assert all(torch.equal(ckptd.load_plain_tensors(d)[k], full[k]) for k in ("a", "b")), step


@pytest.mark.timeout(180)
def test_a_node_budget_in_bytes_is_shared_by_its_ranks(tmp_path, runtime_dir):
    _, out = _run(tmp_path, runtime_dir, "auto", "6MiB")
    assert [o["ring_nbytes"] for o in out] == [3 << 20, 3 << 20]


def _budget_config(runtime_dir: Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, **kw)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("snapshot", ["auto", "copy", "lazy"])
def test_an_object_grown_past_the_ring_gets_a_larger_ring_and_commits_bit_exact(
    tmp_path, single_process, runtime_dir, snapshot
):
    """A plain value (a history list) grows past the 1 MiB ring sized by the first save: it cannot
    be split, and every later save failed with "raise CKPTD_STAGING_BUDGET", which a fractional
    budget never helped (the ring was sized once). Now the save makes a larger ring while the
    previous save still streams through the old one (its writes delayed): both commit bit-exact,
    and the old ring is released once written."""
    cfg = _budget_config(runtime_dir, snapshot=snapshot, staging_budget="0.25x", debug_write_delay_s=1.0)
    w = {1: torch.randn(ROWS, COLS), 2: torch.randn(ROWS, COLS)}  # 4 MiB: a 1 MiB ring, streamed through
    saved = {step: t.clone() for step, t in w.items()}
    hist = {1: list(range(10)), 2: list(range(300_000))}  # the second one pickles to 1.3 MiB
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        h1 = ckpt.save({"w": w[1], "hist": hist[1]}, step=1)
        ckpt.before_update()  # (lazy saves) the optimizer step: the copy is done before w changes
        first = ckpt.status()["rings"]
        assert len(first) == 1 and first[0]["ring_nbytes"] < len(pickle.dumps(hist[2]))  # a quarter of step 1
        h2 = ckpt.save({"w": w[2], "hist": hist[2]}, step=2)  # step 1 is still being written
        ckpt.before_update()
        for t in w.values():
            t.fill_(float("nan"))  # training overwrites right after
        h1.wait(timeout_s=60)
        h2.wait(timeout_s=60)
        rings = ckpt.status()["rings"]
        assert len(rings) == 1 and rings[0]["generation"] != first[0]["generation"]  # the old one released
        assert rings[0]["ring_nbytes"] >= 2 * len(pickle.dumps(hist[2]))
        for step in (1, 2):
            out = ckpt.load({"w": torch.zeros(ROWS, COLS), "hist": None}, step=step)
            assert torch.equal(out["w"], saved[step]) and out["hist"] == hist[step], step


@pytest.mark.timeout(120)
def test_an_object_larger_than_a_byte_budgets_ring_is_named_with_the_budget_that_holds_it(
    tmp_path, single_process, runtime_dir
):
    """A byte budget bounds the node's shared memory, so its ring does not grow: a save with an
    object larger than it fails, naming the object, its size and the budget that holds it (it
    said "raise CKPTD_STAGING_BUDGET", with no size); the next save without it commits."""
    with ckptd.Checkpointer(tmp_path / "run", config=_budget_config(runtime_dir, staging_budget="1MiB")) as ckpt:
        with pytest.raises(StagingError) as err:
            ckpt.save({"w": torch.ones(16), "hist": list(range(300_000))}, step=1)
        message = str(err.value)
        assert "'hist' (rank 0) takes " in message and "CKPTD_STAGING_BUDGET of at least" in message, message
        ckpt.save({"w": torch.ones(16), "hist": [1]}, step=2).wait(timeout_s=60)
