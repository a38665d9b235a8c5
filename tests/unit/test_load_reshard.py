"""Resharding internals in one process: box geometry, raw byte-range reads, fallbacks, layouts."""

from __future__ import annotations

import io
import itertools
import math
import pickle
import random

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import CorruptCheckpointError, LoadMismatchError, ShardingError
from ckptd.format.dcp_metadata import read_index
from ckptd.format.finalize import finalize, serialize_common, write_checkpoint
from ckptd.format.geometry import enumerate_runs, flat_range_boxes, strides
from ckptd.format.items import PlannedItem
from ckptd.format.records import TENSOR, ItemRecord, storage_layout
from ckptd.loading.execute import ExecOptions, LoadStats
from ckptd.loading.loader import LoadRequest, run_load
from ckptd.loading.rawitem import locate
from tests.integration.layouts import split


def test_flat_range_boxes_tile_the_range():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        boxes = flat_range_boxes(shape, a, b)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        flat = torch.arange(n).reshape(shape)
        pos = a
        for off, sizes, start in boxes:
            assert start == pos
            part = flat[tuple(slice(o, o + s) for o, s in zip(off, sizes))].reshape(-1)
            assert torch.equal(part, torch.arange(start, start + part.numel()))
            pos += part.numel()
        assert pos == (b if b > a else a)


def test_runs_cover_the_box_in_order():
    src, dst = (4, 6, 5), (3, 6, 2)
    runs = enumerate_runs(src, (1, 0, 2), dst, (0, 0, 0), (3, 6, 2))
    a = torch.arange(math.prod(src)).reshape(src)
    got = torch.cat([a.reshape(-1)[s : s + runs.length] for s in runs.src_starts]).reshape(3, 6, 2)
    assert torch.equal(got, a[1:4, :, 2:4]) and runs.src_starts == sorted(runs.src_starts)
    assert strides((2, 3, 4)) == (12, 4, 1)


@pytest.mark.parametrize(
    "t",
    [
        torch.randn(3, 4),
        torch.randn(50, 70).to(torch.bfloat16),
        torch.arange(5).to(torch.uint16),
        torch.tensor(3.5),
        torch.zeros(0, 4),
        torch.arange(10.0)[2:5],
        torch.ones(3, dtype=torch.bool),
        torch.randn(2, 2, dtype=torch.complex64),
    ],
)
def test_locate_finds_raw_bytes(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    data = b"head" + buf.getvalue() + b"tail"
    layout = locate(lambda o, n: data[o : o + n], 4, len(buf.getvalue()), t.dtype, tuple(t.shape))
    assert layout is not None and layout.nbytes == t.numel() * t.element_size()
    raw = data[layout.data_offset : layout.data_offset + layout.nbytes]
    if t.numel():
        back = torch.frombuffer(bytearray(raw), dtype=t.dtype).reshape(t.shape)
        assert torch.equal(back, t)


def test_locate_rejects_unusual_items():
    def probe(t: torch.Tensor, shape=None, dtype=None, mutate=None):
        buf = io.BytesIO()
        torch.save(t, buf)
        data = bytearray(buf.getvalue())
        if mutate:
            mutate(data)
        return locate(lambda o, n: bytes(data[o : o + n]), 0, len(data), dtype or t.dtype, shape or tuple(t.shape))

    assert probe(torch.randn(3, 4).t()) is None  # non-contiguous strides
    assert probe(torch.randn(3, 4), shape=(4, 3)) is None  # shape differs from the chunk
    assert probe(torch.randn(3, 4), dtype=torch.float64) is None
    assert probe(torch.nn.Parameter(torch.randn(3))) is None  # a subclass in the pickle
    assert probe(torch.randn(3, 4), mutate=lambda d: d.__setitem__(slice(-22, -18), b"XXXX")) is None
    assert locate(lambda o, n: b"\0" * n, 0, 100, torch.float32, (3,)) is None


def test_fallback_for_non_contiguous_items_and_truncation(tmp_path):
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    d = tmp_path / "c"
    d.mkdir()
    # Item 0 is a transposed (non-contiguous) view saved as is; item 1 a plain chunk.
    with open(d / "__0_0.distcp", "wb") as f:
        start = f.tell()
        torch.save(full[:3].t().contiguous().t(), f)
        rec0 = ItemRecord(
            fqn="w", kind=TENSOR, rank=0, dtype="float32", global_shape=(6, 8), offsets=(0, 0), sizes=(3, 8)
        ).stored_at("__0_0.distcp", start, f.tell() - start)
        start = f.tell()
        torch.save(full[3:].clone(), f)
        rec1 = ItemRecord(
            fqn="w", kind=TENSOR, rank=0, dtype="float32", global_shape=(6, 8), offsets=(3, 0), sizes=(3, 8)
        ).stored_at("__0_0.distcp", start, f.tell() - start)
    finalize(d, [rec0, rec1], serialize_common({}), fsync=False)
    for tp in (1, 2, 3):
        for r in range(tp):
            stats = LoadStats()
            o, s = split(8, tp, r)
            sh = ShardedTensor("w", torch.zeros(6, s), torch.float32, (6, s), (6, 8), (0, o), (1, tp))
            out = ckptd.load({"w": sh}, d, stats=stats)
            assert torch.equal(out["w"], full[:, o : o + s])
            assert stats.fallback_items == 1 and stats.raw_items == 1
    size = (d / "__0_0.distcp").stat().st_size
    with open(d / "__0_0.distcp", "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, d)


def test_legacy_grid_flattened_layout_loads_at_any_layout(tmp_path):
    """Megatron-Core < 0.14 stored flattened shards on a grid: shape (TP grid..., chunk numel)."""
    full = torch.randn(6, 8)
    d = tmp_path / "grid"
    d.mkdir()
    items = []
    for tp in range(2):  # TP=2 on axis 1, each chunk flattened and split over DP=3
        chunk = full[:, tp * 4 : tp * 4 + 4].reshape(-1)
        for dp in range(3):
            lo, n = split(24, 3, dp)
            sh = ShardedTensor(
                "w",
                chunk[lo : lo + n].clone(),
                torch.float32,
                (6, 4),
                (6, 8),
                (0, tp * 4),
                (1, 2),
                flattened_range=slice(lo, lo + n),
            )
            gshape, offs, sizes = storage_layout(sh)
            assert gshape == (1, 2, 24)
            rec = ItemRecord(
                fqn="w", kind=TENSOR, rank=0, dtype="float32", global_shape=gshape, offsets=offs, sizes=sizes
            )
            items.append(PlannedItem(rec, sh.data.reshape(sizes)))
    write_checkpoint(d, [items], {}, fsync=False)
    with pytest.raises(LoadMismatchError, match=r"stores global shape \(1, 2, 24\) but \(6, 8\)"):
        ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, d)
    # What Megatron-Core wrote with it: the real global shape, in .metadata's mcore_data.
    md = pickle.loads((d / ".metadata").read_bytes())
    md.mcore_data = {"w": {"nd_reformulated_orig_global_shape": (6, 8)}}
    (d / ".metadata").write_bytes(pickle.dumps(md))
    out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, d)
    assert torch.equal(out["w"], full)
    flat = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(5), (3, 8), (0, 1, 2), flattened_range=slice(7, 12))
    assert torch.equal(ckptd.load({"f": flat}, d)["f"], full[3:6].reshape(-1)[7:12])
    # The whole-tensor readers give it at its real shape, in its real order (as Megatron-Core's
    # load_tensors_metadata does); they gave the grid, which a reshape to (6, 8) permuted.
    assert ckptd.load_tensors_metadata(d)["w"].global_shape == (6, 8)
    assert torch.equal(ckptd.load_plain_tensors(d)["w"], full)


def test_random_layouts_all_execution_paths(tmp_path):
    """Any saved chunking (N-D / flattened) to any requested chunking, through every read path."""
    rng = random.Random(1)
    paths = [
        ExecOptions(),
        ExecOptions(direct_min_bytes=0, gap_fill_bytes=8),
        ExecOptions(direct_min_bytes=1 << 30, use_mmap=False, window_bytes=16),
        ExecOptions(direct_min_bytes=1 << 30, map_window_bytes=4096),
    ]

    def layout(full: torch.Tensor, key: str) -> dict:
        shape = tuple(full.shape)
        grid = tuple(rng.randint(1, min(3, s)) for s in shape)
        dp = rng.choice([None, 1, 2, 3])
        out = {}
        for cell in itertools.product(*[range(g) for g in grid]):
            offs, sizes = zip(*[split(n, g, c) for n, g, c in zip(shape, grid, cell)])
            box = full[tuple(slice(o, o + s) for o, s in zip(offs, sizes))]
            if dp is None:
                out[str(cell)] = ShardedTensor(key, box.clone(), full.dtype, sizes, shape, offs, grid)
                continue
            for r in range(dp):
                lo, n = split(math.prod(sizes), dp, r)
                out[f"{cell}/{r}"] = ShardedTensor(
                    key,
                    box.reshape(-1)[lo : lo + n].clone(),
                    full.dtype,
                    sizes,
                    shape,
                    offs,
                    grid,
                    flattened_range=slice(lo, lo + n),
                )
        return out

    for trial in range(24):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(1, 4)))
        full = (torch.randn(shape) * 50).to(rng.choice([torch.float32, torch.bfloat16, torch.int32]))
        d = tmp_path / f"t{trial}"
        ckptd.save(layout(full, "t"), d, fsync=False)
        index = read_index(d)
        for opts in paths:
            req = layout(full, "t")
            want = {k: v.data.clone() for k, v in req.items()}
            for v in req.values():
                v.data.fill_(3)
            stats = LoadStats()
            out = run_load(index, LoadRequest(req, d, stats=stats, options=opts))
            assert all(torch.equal(out[k], want[k]) for k in req), (shape, opts)
            assert stats.fallback_items == 0


def test_reads_only_needed_bytes(tmp_path):
    full = torch.randn(64, 1024)
    # Without checksums: a part read is checked by reading its blocks again (test_load_checksums).
    ckptd.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path / "c", fsync=False, checksums=False)
    for rows in (16, 32):  # contiguous rows: exactly the rows' bytes plus a little header probing
        stats = LoadStats()
        sh = ShardedTensor.from_rank_offsets("w", torch.empty(rows, 1024), (0, 1, 64 // rows))
        ckptd.load({"w": sh}, tmp_path / "c", stats=stats)
        assert rows * 4096 <= stats.bytes_read <= rows * 4096 + 16384
        assert stats.peak_scratch_bytes == 0 and stats.bytes_mapped == 0
    stats = LoadStats()  # a column block: strided, through a mapping of only the needed span
    sh = ShardedTensor.from_rank_offsets("w", torch.empty(64, 256), (1, 2, 4))
    out = ckptd.load({"w": sh}, tmp_path / "c", stats=stats)
    assert torch.equal(out["w"], full[:, 512:768])
    assert stats.bytes_mapped < 64 * 4096 and stats.peak_scratch_bytes == 0


def test_dcp_interop_both_ways(tmp_path):
    import torch.distributed.checkpoint as dcp

    full = torch.randn(10, 6)
    # ckptd saves a flattened (distributed-optimizer) tensor; plain torch DCP reads it whole.
    shards = {}
    for r in range(3):
        lo, n = split(60, 3, r)
        shards[r] = ShardedTensor.from_rank_offsets_flat(
            "w", full.reshape(-1)[lo : lo + n].clone(), (10, 6), flattened_range=slice(lo, lo + n)
        )
    ckptd.save(shards, tmp_path / "ck", fsync=False)
    target = {"w": torch.zeros(10, 6)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(target["w"], full)
    # torch DCP saves; ckptd reshards it with raw byte-range reads (no torch.load fallback).
    dcp.save({"v": full}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    stats = LoadStats()
    sh = ShardedTensor.from_rank_offsets_flat("v", torch.zeros(7), (5, 6), (0, 1, 2), flattened_range=slice(11, 18))
    out = ckptd.load({"v": sh}, tmp_path / "dcp", stats=stats)
    assert torch.equal(out["v"], full[5:].reshape(-1)[11:18]) and stats.fallback_items == 0


def test_flattened_range_errors(tmp_path):
    with pytest.raises(ShardingError, match="flattened_range"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(5), (2, 2), flattened_range=slice(0, 5))
    ckptd.save({"w": ShardedTensor.from_rank_offsets("w", torch.randn(2, 2))}, tmp_path / "c", fsync=False)
    sh = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(2), (2, 2), flattened_range=slice(1, 3))
    sh.flattened_range = slice(3, 5)  # edited after construction: out of the chunk's 4 elements
    with pytest.raises(ShardingError, match=r"flattened_range .* within \[0, 4\]"):
        ckptd.load({"w": sh}, tmp_path / "c")
    with pytest.raises(LoadMismatchError, match="stores torch.float32 but torch.float64"):
        req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2, dtype=torch.float64))}
        ckptd.load(req, tmp_path / "c", allow_dtype_cast=False)


def test_non_contiguous_destination_and_prepended_axes(tmp_path):
    full = torch.randn(3, 5, 4)
    ckptd.save(
        {
            f"l{i}": ShardedTensor.from_rank_offsets("stack", full[i].clone(), (0, i, 3), prepend_axis_num=1)
            for i in range(3)
        },
        tmp_path / "c",
        fsync=False,
    )
    dst = torch.zeros(4, 5).t()  # a transposed (non-contiguous) view: filled through a temporary
    out = ckptd.load(
        {"x": ShardedTensor.from_rank_offsets("stack", dst, (0, 1, 3), prepend_axis_num=1)}, tmp_path / "c"
    )
    assert out["x"] is dst and torch.equal(dst, full[1])
    assert torch.equal(ckptd.load_plain_tensors(tmp_path / "c")["stack"], full)


def test_a_regular_tensor_that_fits_the_grid_pattern_is_not_taken_for_one(tmp_path):
    """A (2, 2, 4) tensor sharded on its first two axes has the shape and chunks of a (4, 4) tensor
    in the legacy grid layout: requested as (4, 4) (a changed model config), it loaded permuted
    ([[0, 1, 4, 5], [2, 3, 6, 7], ...]) instead of failing."""
    w = torch.arange(16.0).reshape(2, 2, 4)
    sd = {
        f"p{i}{j}": ShardedTensor.from_rank_offsets("w", w[i : i + 1, j : j + 1].clone(), (0, i, 2), (1, j, 2))
        for i in range(2)
        for j in range(2)
    }
    ckptd.save(sd, tmp_path / "c")
    with pytest.raises(LoadMismatchError, match=r"stores global shape \(2, 2, 4\) but \(4, 4\) was requested"):
        ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, tmp_path / "c")


def test_a_conjugate_or_negative_view_is_loaded_with_its_values_not_its_memory(tmp_path):
    """A conjugate (``.conj()``) or negative view keeps the conjugate or negation of its values in
    memory: the stored bytes were read straight into it, so it held the conjugates (as torch DCP
    does not)."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, -2.0])
    ckptd.save({"z": z.clone(), "x": x.clone()}, tmp_path / "c")
    dst = {"z": torch.zeros(2, dtype=torch.complex64).conj(), "x": torch._neg_view(torch.zeros(2))}
    assert dst["z"].is_conj() and dst["x"].is_neg()
    ckptd.load(dst, tmp_path / "c")
    assert torch.equal(dst["z"], z) and torch.equal(dst["x"], x)


def test_a_requested_tensor_of_no_element_needs_nothing_stored(tmp_path):
    """An earlier ckptd left a DTensor of no element out of its checkpoints; a load that requests
    it (only the mesh's first rank does: the others hold no piece) failed on that rank alone, and
    the others went on into the next collective."""
    ckptd.save({"w": torch.ones(4)}, tmp_path / "c")
    out = ckptd.load({"w": torch.zeros(4), "e": torch.ones(0, 4)}, tmp_path / "c", strict="raise_all")
    assert torch.equal(out["w"], torch.ones(4)) and out["e"].shape == (0, 4)
    piece = ShardedTensor.from_rank_offsets("e", torch.empty(0, 4), (1, 0, 2)).without_data()  # global (0, 8)
    assert ckptd.load({"w": torch.zeros(4), "e": piece}, tmp_path / "c")["e"].shape == (0, 4)  # its own shape
    # What the checkpoint holds under the key is a mismatch to report, not an empty tensor.
    ckptd.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "buf": torch.ones(3)}, tmp_path / "m")
    with pytest.raises(LoadMismatchError, match="common state"):
        ckptd.load({"w": torch.zeros(2), "buf": torch.empty(0)}, tmp_path / "m")
    ckptd.save({"w": torch.ones(2), "x": 5}, tmp_path / "v")
    with pytest.raises(LoadMismatchError, match=r"\['x'\]"):
        ckptd.load({"x": torch.empty(0)}, tmp_path / "v", strict="raise_all")
