"""The sharded state-dict API and the torch_dist files it writes (single process).

Covers the state-dict vocabulary (factories, LocalNonPersistentObject, nesting, prepend_axis_num),
the metadata functions, the on-disk layout and its size bound (views of larger buffers are not
written whole), and reading a plain torch DCP checkpoint's common state.
"""

from __future__ import annotations

import io
import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import ckptd
from ckptd import LocalNonPersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from ckptd.errors import LoadMismatchError, StorageError
from tests.interop.reference import assert_compact, same_bits

ST = ShardedTensor
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ------------------------------------------------------------------------------------ layout


def test_layout_is_torch_dist(tmp_path: Path):
    param = torch.nn.Parameter(torch.randn(4, 6))  # a model parameter: requires grad
    x = param.detach()
    ckptd.save(
        {"x": ST.from_rank_offsets("x", param), "o": ShardedObject("o", {"a": 1}, (1,), (0,)), "step": 2},
        tmp_path / "c",
    )
    c = tmp_path / "c"
    assert sorted(p.name for p in c.iterdir()) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((c / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert torch.load(c / "common.pt", weights_only=True) == {"step": 2}
    md = pickle.loads((c / ".metadata").read_bytes())
    assert isinstance(md, Metadata) and set(md.state_dict_metadata) == {"x", "o/shard_0_1"}
    data = (c / "__0_0.distcp").read_bytes()
    # Every item is a standalone torch.save stream at the offset .metadata records (DCP's format).
    items = {idx.fqn: info for idx, info in md.storage_data.items()}
    x_info, o_info = items["x"], items["o/shard_0_1"]
    item = torch.load(io.BytesIO(data[x_info.offset : x_info.offset + x_info.length]), weights_only=True)
    assert same_bits(item, x) and type(item) is torch.Tensor and not item.requires_grad
    assert torch.load(io.BytesIO(data[o_info.offset : o_info.offset + o_info.length]), weights_only=True) == [{"a": 1}]
    assert x_info.length + o_info.length == len(data)


def test_views_of_larger_buffers_are_stored_compactly(tmp_path: Path):
    # Parameters living in one contiguous buffer (as in Megatron's DDP / distributed optimizer).
    big = torch.randn(512, 512)  # 1 MiB: writing it once would break the bound below
    flat = big.view(-1)
    state = {
        "rows": ST.from_rank_offsets("rows", big[100:164]),  # contiguous slice, storage offset
        "cols": ST.from_rank_offsets("cols", big[:, 8:16]),  # strided view
        "layers": [ST.from_rank_offsets("layers", big[i], (0, i, 2), prepend_axis_num=1) for i in range(2)],
        "flat": [  # one (16, 32) tensor as two flattened pieces, from far apart in the buffer
            ST.from_rank_offsets_flat("flat", flat[1000:1300], (16, 32), (0, 0, 1), flattened_range=slice(0, 300)),
            ST.from_rank_offsets_flat("flat", flat[9000:9212], (16, 32), (0, 0, 1), flattened_range=slice(300, 512)),
        ],
        "obj": ShardedObject("obj", {"t": big[0, :16], "n": 1}, (1,), (0,)),
        "common": {"t": big[1, :16], "pair": (big[2, :4], big[2, 4:8])},
    }
    ckptd.save(state, tmp_path / "c")
    tensor_nbytes = 4 * (64 * 512 + 512 * 8 + 2 * 512 + 512 + 16 + 16 + 8)
    assert_compact(tmp_path / "c", tensor_nbytes)

    out = ckptd.load(
        {
            "rows": ST.from_rank_offsets("rows", torch.empty(64, 512)),
            "cols": ST.from_rank_offsets("cols", torch.empty(512, 8)),
            "layers": ST.from_rank_offsets("layers", torch.empty(2, 512)),
            "flat": ST.from_rank_offsets("flat", torch.empty(16, 32)),
            "obj": ShardedObject("obj", None, (1,), (0,)),
        },
        tmp_path / "c",
    )
    assert same_bits(out["rows"], big[100:164]) and same_bits(out["cols"], big[:, 8:16])
    assert same_bits(out["layers"], big[:2])
    assert same_bits(out["flat"].view(-1), torch.cat([flat[1000:1300], flat[9000:9212]]))
    assert same_bits(out["obj"]["t"], big[0, :16]) and out["obj"]["n"] == 1
    assert same_bits(out["common"]["t"], big[1, :16])
    assert all(map(same_bits, out["common"]["pair"], (big[2, :4], big[2, 4:8])))
    assert big.untyped_storage().nbytes() == 512 * 512 * 4  # the caller's buffer is untouched


def test_large_checkpoint_meets_the_size_bound(tmp_path: Path):
    # Many items, several MiB: the per-item overhead and the 2 % factor together.
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(64 + i, 97, generator=g).to(dt)
        for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool] * 4)
    }
    ckptd.save({k: ST.from_rank_offsets(k, v) for k, v in tensors.items()}, tmp_path / "c")
    assert_compact(tmp_path / "c", sum(v.numel() * v.element_size() for v in tensors.values()))


# ------------------------------------------------------------------------ state-dict vocabulary


def _fused_factory(key: str, data: torch.Tensor) -> ShardedTensorFactory:
    """A fused (q; k) weight stored as two tensors ``<key>.q`` and ``<key>.k``."""

    def build(k: str, t: torch.Tensor, replica_id: Any, flattened_range: Any) -> dict:
        q, kk = t.chunk(2)
        return {"q": ST.from_rank_offsets(f"{k}.q", q), "k": ST.from_rank_offsets(f"{k}.k", kk)}

    def merge(pieces: dict) -> torch.Tensor:
        return torch.cat([pieces["q"], pieces["k"]])

    return ShardedTensorFactory(key, data, build, merge)


def test_factory_round_trip(tmp_path: Path):
    qk = torch.randn(8, 3)
    ckptd.save({"attn": {"qk": _fused_factory("attn.qk", qk)}}, tmp_path / "c")
    stored = ckptd.load_tensors_metadata(tmp_path / "c")
    assert sorted(stored) == ["attn.qk.k", "attn.qk.q"] and stored["attn.qk.q"].global_shape == (4, 3)
    out = ckptd.load({"attn": {"qk": _fused_factory("attn.qk", torch.empty(8, 3))}}, tmp_path / "c")
    assert same_bits(out["attn"]["qk"], qk)
    assert same_bits(ckptd.load_plain_tensors(tmp_path / "c")["attn.qk.k"], qk[4:])


def test_local_non_persistent_object(tmp_path: Path):
    handle = object()  # not even picklable by weights_only; never saved
    ckptd.save(
        {"x": ST.from_rank_offsets("x", torch.ones(2)), "local": LocalNonPersistentObject(lambda: 1), "step": 1},
        tmp_path / "c",
    )
    assert ckptd.load_common_state_dict(tmp_path / "c") == {"step": 1}
    out = ckptd.load(
        {"x": ST.from_rank_offsets("x", torch.empty(2)), "local": LocalNonPersistentObject(handle)}, tmp_path / "c"
    )
    assert out["local"] is handle and out["step"] == 1


def test_nested_dicts_and_lists(tmp_path: Path):
    a, b, c = torch.randn(3), torch.randn(2, 2), torch.arange(4)

    def state(ta, tb, tc):
        return {
            "model": [{"a": ST.from_rank_offsets("a", ta), "lr": 0.1}, {"b": ST.from_rank_offsets("b", tb), "lr": 0.2}],
            "opt": {"state": {0: {"c": ST.from_rank_offsets("c", tc)}}, "groups": [{"wd": 0.0}], "empty": {}},
            "rng": [ShardedObject("rng", {"seed": 3}, (1,), (0,))],
            "iteration": 5,
        }

    ckptd.save(state(a, b, c), tmp_path / "c")
    # As Megatron-Core stores it: subtrees whose entries were all sharded are left out.
    assert ckptd.load_common_state_dict(tmp_path / "c") == {
        "model": [{"lr": 0.1}, {"lr": 0.2}],
        "opt": {"groups": [{"wd": 0.0}], "empty": {}},
        "iteration": 5,
    }
    req = state(torch.empty(3), torch.empty(2, 2), torch.empty(4, dtype=torch.int64))
    req["rng"][0] = ShardedObject("rng", None, (1,), (0,))
    out = ckptd.load(req, tmp_path / "c")
    assert same_bits(out["model"][0]["a"], a) and same_bits(out["model"][1]["b"], b)
    assert out["model"][0]["lr"] == 0.1 and out["model"][1]["lr"] == 0.2
    assert same_bits(out["opt"]["state"][0]["c"], c) and out["opt"]["empty"] == {}
    assert out["opt"]["groups"] == [{"wd": 0.0}] and out["rng"] == [{"seed": 3}] and out["iteration"] == 5


def test_prepend_axis_num_layers(tmp_path: Path):
    layers = torch.randn(3, 4, 5)
    ckptd.save(
        {f"l{i}": ST.from_rank_offsets("w", layers[i].clone(), (0, i, 3), prepend_axis_num=1) for i in range(3)},
        tmp_path / "c",
    )
    assert ckptd.load_tensors_metadata(tmp_path / "c")["w"].global_shape == (3, 4, 5)
    assert same_bits(ckptd.load_plain_tensors(tmp_path / "c")["w"], layers)
    # Per layer again (into the given tensor), and as a stack of layers split along another axis.
    target = torch.empty(4, 5)
    out = ckptd.load({"l1": ST.from_rank_offsets("w", target, (0, 1, 3), prepend_axis_num=1)}, tmp_path / "c")
    assert out["l1"] is target and same_bits(target, layers[1])
    out = ckptd.load({"cols": ST.from_rank_offsets("w", torch.empty(3, 4, 1), (2, 4, 5))}, tmp_path / "c")
    assert same_bits(out["cols"], layers[:, :, 4:])


def test_metadata_functions(tmp_path: Path):
    x, y = torch.randn(4, 6), torch.randint(0, 9, (5,))
    ckptd.save(
        {
            "x": [ST.from_rank_offsets("x", x[2 * r : 2 * r + 2], (0, r, 2)) for r in range(2)],
            "y": ST.from_rank_offsets("y", y),
            "o": [ShardedObject("o", r, (2,), (r,)) for r in range(2)],
            "step": 9,
        },
        tmp_path / "c",
    )
    c = tmp_path / "c"
    tensors = ckptd.load_tensors_metadata(c)
    assert sorted(tensors) == ["x", "y"]
    assert (tensors["x"].global_shape, tensors["x"].dtype, tensors["x"].data) == ((4, 6), torch.float32, None)
    assert tensors["y"].dtype == torch.int64
    sharded = ckptd.load_sharded_metadata(c)
    assert sorted(sharded) == ["o/shard_0_2", "o/shard_1_2", "x", "y"]
    assert sharded["o/shard_1_2"].global_offset == (1,) and sharded["o/shard_1_2"].data is None
    # Lists whose entries were all sharded are left out of the common state (as Megatron-Core does).
    assert ckptd.load_common_state_dict(c) == {"step": 9}
    plain = ckptd.load_plain_tensors(c)
    assert sorted(plain) == ["x", "y"] and same_bits(plain["x"], x) and same_bits(plain["y"], y)
    # The metadata templates are valid load requests.
    loaded = ckptd.load(dict(sharded), c)
    assert same_bits(loaded["x"], x) and loaded["o/shard_1_2"] == 1


def test_object_keys_lacking_the_shapes_last_dimension_load_at_the_whole_shape(tmp_path: Path, monkeypatch):
    # An older Megatron-Core stored ShardedObjects under keys whose shape lacks its last dimension
    # (Megatron-Core reads it as -1): load_sharded_metadata crashed on them, a load found none.
    def legacy_key(self):
        offsets, shape = ".".join(map(str, self.global_offset)), ".".join(map(str, self.global_shape[:-1]))
        return f"{self.key}/shard_{offsets}_{shape}"

    c = tmp_path / "c"
    with monkeypatch.context() as m:
        m.setattr(ShardedObject, "unique_key", property(legacy_key))
        ckptd.save({"rng": [ShardedObject("rng", (i, j), (2, 3), (i, j)) for i in range(2) for j in range(3)]}, c)
    from ckptd.format.dcp_metadata import read_index

    assert "rng/shard_1.2_2" in read_index(c).objects  # as that Megatron-Core stored it
    sharded = ckptd.load_sharded_metadata(c)
    assert sorted(sharded) == [f"rng/shard_{i}.{j}_2.3" for i in range(2) for j in range(3)]
    assert sharded["rng/shard_1.2_2.3"].global_shape == (2, 3)
    assert ckptd.load({"rng": ShardedObject("rng", None, (2, 3), (1, 2))}, c)["rng"] == (1, 2)
    assert ckptd.load(dict(sharded), c)["rng/shard_0.1_2.3"] == (0, 1)
    from ckptd.convert.consolidate import load_sharded_objects

    assert load_sharded_objects(c, allow_unsafe_pickle=False)["rng/shard_1.0_2.3"] == (1, 0)


# ------------------------------------------------------------------------ plain torch DCP


def test_plain_dcp_checkpoint_common_state(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    x = torch.randn(3, 2)
    state = {"x": x, "step": 5, "opt": {"lr": 0.1, "betas": [0.9, 0.99], "scale": torch.tensor(2.0)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # default: flattened keys
    # DCP's byte items "step", "opt.lr", "opt.betas" nest back along its planner_data.
    common = ckptd.load_common_state_dict(tmp_path / "dcp")
    assert common == {"step": 5, "opt": {"lr": 0.1, "betas": [0.9, 0.99]}}
    # A Megatron-style request gets the plain values it names (decoded only those) from the items.
    out = ckptd.load(
        {
            "x": ST.from_rank_offsets("x", torch.empty(3, 2)),
            "scale": ST("opt.scale", torch.empty(()), torch.float32, (), (), (), None),
            "opt": {"lr": None, "betas": None},
        },
        tmp_path / "dcp",
    )
    assert same_bits(out["x"], x) and out["scale"].item() == 2.0 and out["opt"]["lr"] == 0.1
    assert math.isclose(out["opt"]["betas"][1], 0.99) and "step" not in out
    # ... and the plain tensors it names, from their tensor items (they were left out, in every
    # strict mode); one of another shape is a mismatch.
    for strict in ("assume_ok_unexpected", "raise_all"):
        b = torch.zeros(())
        out = ckptd.load(
            {"x": ST.from_rank_offsets("x", torch.empty(3, 2)), "opt": {"scale": b, "lr": None}},
            tmp_path / "dcp",
            strict=strict,
        )
        assert out["opt"]["scale"] is b and b.item() == 2.0 and out["opt"]["lr"] == 0.1
    with pytest.raises(LoadMismatchError, match="opt.scale"):
        ckptd.load(
            {"x": ST.from_rank_offsets("x", torch.empty(3, 2)), "opt": {"scale": torch.zeros(2)}}, tmp_path / "dcp"
        )
    # A DCP-style request is filled in place, as torch DCP's load does.
    req = {"x": torch.zeros(3, 2), "step": 0, "opt": {"lr": 0.0, "betas": [], "scale": torch.tensor(0.0)}}
    x_target = req["x"]
    assert ckptd.load(req, tmp_path / "dcp") is req
    assert req["x"] is x_target and same_bits(x_target, x) and req["step"] == 5
    assert req["opt"]["lr"] == 0.1 and req["opt"]["betas"] == [0.9, 0.99] and req["opt"]["scale"].item() == 2.0


def test_a_root_made_for_the_first_checkpoint_is_synced_into_its_parents(tmp_path, monkeypatch):
    """The daemon and the Checkpointer made a new root with mkdir -p, and a commit fsyncs the root,
    not its entry in its parent: a power loss could take the first checkpoint with the root."""
    from ckptd.format import durable

    synced: list[str] = []
    monkeypatch.setattr(durable, "fsync_dir", lambda p: synced.append(str(p)))
    durable.make_dirs_durably(tmp_path / "a" / "b", fsync=True)
    assert (tmp_path / "a" / "b").is_dir() and synced == [str(tmp_path), str(tmp_path / "a")]
    durable.make_dirs_durably(tmp_path / "a" / "b", fsync=True)  # there already: nothing to sync
    durable.make_dirs_durably(tmp_path / "c" / "d", fsync=False)  # fsync off: made, not synced
    assert (tmp_path / "c" / "d").is_dir() and len(synced) == 2
    (tmp_path / "f").write_text("")  # a file where a directory goes: said so, not a raw OSError
    with pytest.raises(StorageError, match=f"{tmp_path / 'f'} is a file, not a directory, so the checkpoint root"):
        durable.make_dirs_durably(tmp_path / "f" / "c", fsync=True)
    with pytest.raises(StorageError, match=f"the checkpoint root {tmp_path / 'f'} is a file, not a directory"):
        durable.make_dirs_durably(tmp_path / "f", fsync=True)


def test_a_zero_dimensional_sharded_object_is_described_by_load_sharded_metadata(tmp_path: Path):
    """Its key is ``o/shard__`` (no offsets, no shape): it saved and loaded, but
    load_sharded_metadata raised parsing it back."""
    sd = {"o": ShardedObject("o", {"a": 1}, (), ()), "w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}
    ckptd.save(sd, tmp_path / "c")
    meta = ckptd.load_sharded_metadata(tmp_path / "c")
    assert (meta["o/shard__"].global_shape, meta["o/shard__"].global_offset) == ((), ())
    assert ShardedObject.empty_from_unique_key("o/shard__").unique_key == "o/shard__"


def test_a_synchronous_save_makes_its_new_directories_durable_and_says_what_a_late_fsync_left(tmp_path, monkeypatch):
    """ckptd.save made a new run1/step100 with mkdir -p and fsynced only run1 (not the entry of
    run1 in its parent); and a failed fsync of that entry, with metadata.json in place, said
    "Nothing was committed and this save's files were removed" of a checkpoint that stays and loads."""
    from ckptd import api
    from ckptd.format import durable

    synced: list[str] = []
    monkeypatch.setattr(durable, "fsync_dir", lambda p: synced.append(str(p)))
    monkeypatch.setattr(api, "fsync_dir", lambda p: synced.append(str(p)))
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}
    ckptd.save(sd, tmp_path / "run1" / "step100")
    assert str(tmp_path) in synced and str(tmp_path / "run1") in synced

    def failing(path: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(api, "fsync_dir", failing)
    with pytest.raises(ckptd.SaveFailedError, match="is complete and loads, but its entry"):
        ckptd.save(sd, tmp_path / "run2")
    out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path / "run2")
    assert torch.equal(out["w"], torch.ones(2))
