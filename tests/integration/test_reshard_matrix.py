"""Save at every (TP, DP) layout, load at every other one, bit-exact, on real gloo processes.

One 4-rank run saves six layouts ((2,1), (1,2), (2,2), (4,1) and the uneven (3,1), (1,3)) into
six directories (sub-groups for the smaller worlds), then loads them at the world-size-4 layouts;
one 3-rank and one 2-rank run load them at their layouts. Each load asks for model tensors as
N-D shards *and* as flattened (distributed-optimizer) shards, and for the flattened optimizer
state as flattened shards of the new DP/TP split *and* as N-D shards, and compares every element
with the reference full tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptd
from ckptd.loading.execute import LoadStats
from tests.integration.layouts import (
    MODEL,
    Layout,
    expected_flat,
    expected_nd,
    optim_reference,
    reference,
)
from tools.harness.ranks import run_ranks

SAVE_LAYOUTS = [Layout(2, 1), Layout(1, 2), Layout(2, 2), Layout(4, 1), Layout(3, 1), Layout(1, 3)]
KEYS = list(MODEL)
OPT = "optimizer.state.exp_avg."


def _save_state(layout: Layout, rank: int) -> dict:
    model = {k: layout.model_shard(k, rank, reference(k)) for k in KEYS}
    ranges = layout.flat_ranges(KEYS, rank)
    optim = {k: layout.flat_shard(k, OPT + k, rank, fr, torch.float32, optim_reference(k)) for k, fr in ranges.items()}
    return {"model": model, "optimizer": optim, "iteration": 42, "layout": layout.name}


def _load_and_check(layout: Layout, rank: int, directory: str) -> tuple[int, int]:
    """Load ``directory`` at ``layout`` as ``rank``; returns (elements checked, fallback items)."""
    model_nd = {k: layout.model_shard(k, rank, None) for k in KEYS}
    ranges = layout.flat_ranges(KEYS, rank)
    model_flat = {k: layout.flat_shard(k, k, rank, fr, MODEL[k][1], None) for k, fr in ranges.items()}
    optim_flat = {k: layout.flat_shard(k, OPT + k, rank, fr, torch.float32, None) for k, fr in ranges.items()}
    optim_nd = {}
    for k in KEYS:
        sh = layout.model_shard(k, rank, None)
        optim_nd[k] = ckptd.ShardedTensor(
            OPT + k,
            torch.full(sh.local_shape, 7.0),
            torch.float32,
            sh.local_shape,
            sh.global_shape,
            sh.global_offset,
            sh.axis_fragmentations,
        )
    request = {"model": model_nd, "model_flat": model_flat, "optim_flat": optim_flat, "optim_nd": optim_nd}
    stats = LoadStats()
    out = ckptd.load(request, directory, stats=stats)
    assert out["iteration"] == 42
    checked = 0
    for k in KEYS:
        ref, oref = reference(k), optim_reference(k)
        pairs = [(out["model"][k], expected_nd(ref, model_nd[k])), (out["optim_nd"][k], expected_nd(oref, optim_nd[k]))]
        if k in ranges:
            pairs += [
                (out["model_flat"][k], expected_flat(ref, model_flat[k])),
                (out["optim_flat"][k], expected_flat(oref, optim_flat[k])),
            ]
        for got, want in pairs:
            assert got.dtype == want.dtype and torch.equal(got, want), (
                f"{k}: load of {directory} at {layout.name} rank {rank} differs"
            )
            checked += want.numel()
    # In place: the request's own buffers were filled.
    assert all(out["model"][k].data_ptr() == model_nd[k].data.data_ptr() for k in KEYS)
    return checked, stats.fallback_items


def _load_all(layouts: list[Layout], rank: int, dirs: dict[str, str]) -> list[tuple[str, str, int, int]]:
    results = []
    for layout in layouts:
        if rank >= layout.world:
            continue
        for saved, directory in sorted(dirs.items()):
            if saved == layout.name:
                continue
            checked, fallbacks = _load_and_check(layout, rank, directory)
            results.append((saved, layout.name, checked, fallbacks))
    return results


def _save_all_then_load(rank: int, world: int, root: str, load_layouts: list[Layout]) -> list:
    dirs = {}
    groups = [dist.new_group(list(range(layout.world))) for layout in SAVE_LAYOUTS]  # all ranks
    for layout, group in zip(SAVE_LAYOUTS, groups):
        directory = str(Path(root) / layout.name)
        dirs[layout.name] = directory
        if rank < layout.world:
            ckptd.save(_save_state(layout, rank), directory, process_group=group, fsync=False)
    dist.barrier()
    return _load_all(load_layouts, rank, dirs)


def _load_only(rank: int, world: int, dirs: dict[str, str], load_layouts: list[Layout]) -> list:
    return _load_all(load_layouts, rank, dirs)


def _check(results: list[list], layouts: list[Layout]) -> None:
    flat = [r for per_rank in results for r in per_rank]
    pairs = {(s, t) for s, t, _, _ in flat}
    expected = {(s.name, t.name) for s in SAVE_LAYOUTS for t in layouts if s != t}
    assert pairs == expected
    assert all(checked > 0 for _, _, checked, _ in flat)
    assert all(fallbacks == 0 for _, _, _, fallbacks in flat)  # raw byte-range reads throughout


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    layouts = [Layout(2, 2), Layout(4, 1)]
    results = run_ranks(_save_all_then_load, 4, str(root), layouts, timeout_s=150)
    return {layout.name: str(root / layout.name) for layout in SAVE_LAYOUTS}, results, layouts


@pytest.mark.timeout(200)
def test_matrix_world4_saves_all_and_loads(saved):
    dirs, results, layouts = saved
    assert all((Path(d) / "metadata.json").is_file() for d in dirs.values())
    _check(results, layouts)


@pytest.mark.timeout(150)
def test_matrix_world3_uneven(saved):
    dirs, _, _ = saved
    layouts = [Layout(3, 1), Layout(1, 3)]
    _check(run_ranks(_load_only, 3, dirs, layouts, timeout_s=120), layouts)


@pytest.mark.timeout(150)
def test_matrix_world2(saved):
    dirs, _, _ = saved
    layouts = [Layout(2, 1), Layout(1, 2)]
    _check(run_ranks(_load_only, 2, dirs, layouts, timeout_s=120), layouts)


def test_flattened_optimizer_state_is_stored_in_its_real_shape(saved):
    """Flattened shards are stored as N-D pieces: plain readers see the real global tensor."""
    dirs, _, _ = saved
    meta = ckptd.load_tensors_metadata(dirs["tp2dp2"])
    for k in KEYS:
        assert meta[OPT + k].global_shape == MODEL[k][0]
    plain = ckptd.load_plain_tensors(dirs["tp1dp3"])
    assert all(torch.equal(plain[OPT + k], optim_reference(k)) for k in KEYS)


def _megatron_loads_nd(rank: int, world: int, directory: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as mdc

    checked = 0
    for k in ("layer.qkv.weight", "layer.conv.weight"):
        axis = MODEL[k][2]
        full = optim_reference(k)
        for r in range(2):
            part = full.chunk(2, axis)[r]
            req = {"x": mdc.ShardedTensor.from_rank_offsets(OPT + k, torch.zeros_like(part), (axis, r, 2))}
            out = mdc.load(req, directory, validate_access_integrity=False)
            assert torch.equal(out["x"], part), k
            checked += 1
    return checked


@pytest.mark.timeout(150)
def test_megatron_core_loads_flattened_optimizer_state_as_nd(saved):
    """Megatron-Core 0.16 rejects flattened ranges, but reads what a ckptd distributed optimizer
    saved (DP=3, uneven) as ordinary N-D shards at TP=2."""
    dirs, _, _ = saved
    assert run_ranks(_megatron_loads_nd, 1, dirs["tp1dp3"], timeout_s=120) == [4]
