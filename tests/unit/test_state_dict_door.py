"""The one door of every state dict (ckptd.statedict), single process: what is refused, how
DCP-style state dicts are stored and filled in place, and the interop fixes of the format.

Multi-rank cases (Megatron-Core's own classes, DTensors on meshes) are in
tests/interop/test_real_inputs.py; real models in tests/real/.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd import LoadMismatchError, ShardedObject, ShardedTensor, ShardingError, UnsafePickleError
from ckptd.format.dcp_metadata import read_index
from tests.interop.reference import same_bits

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Quantized(torch.Tensor):
    """A tensor subclass ckptd does not know (as a float8 or a fake tensor would be)."""


class _TensorLike:
    """Not a tensor, but takes part in torch's dispatch (torch.overrides.is_tensor_like)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return NotImplemented


@dataclass
class ShardedTensor2:  # a sharded object of some other library, named like Megatron's
    key: str
    data: torch.Tensor


ShardedTensor2.__name__ = ShardedTensor2.__qualname__ = "ShardedTensor"
ShardedTensor2.__module__ = "otherlib.mapping"


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.parametrize(
    "value, what",
    [
        (torch.ones(3).as_subclass(_Quantized), "a torch.Tensor subclass"),
        (_TensorLike(torch.ones(3)), "a tensor-like object"),
        (ShardedTensor2("w", torch.ones(3)), "a sharded object of a library ckptd does not know"),
    ],
)
@pytest.mark.parametrize("megatron_style", [False, True])
def test_values_ckptd_cannot_place_raise_naming_the_key(tmp_path: Path, value, what, megatron_style):
    sd = {"model": {"w": torch.randn(2)}, "opt": {"state": {"x": value}}}
    if megatron_style:
        sd["model"]["w"] = ShardedTensor.from_rank_offsets("w", torch.randn(2))
    with pytest.raises(ShardingError, match=rf"'opt\.state\.x' is of type .*, {what}"):
        ckptd.save(sd, tmp_path / "c")
    assert not (tmp_path / "c").exists()  # nothing was written


def test_tensor_data_hidden_in_objects_or_tuples_is_refused(tmp_path: Path):
    w = ShardedTensor.from_rank_offsets("w", torch.randn(2))
    with pytest.raises(ShardingError, match="common state: a value is of type .*_Quantized"):
        ckptd.save({"w": w, "cfg": _Holder(torch.ones(2).as_subclass(_Quantized))}, tmp_path / "a")
    with pytest.raises(ShardingError, match=r"ShardedTensor at 'pair\.1' sits inside a tuple"):
        ckptd.save({"w": w, "pair": (1, ShardedTensor.from_rank_offsets("v", torch.ones(1)))}, tmp_path / "b")
    with pytest.raises(ShardingError, match="'x' at x .*data is a .*_Quantized, a tensor subclass"):
        ckptd.save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(2).as_subclass(_Quantized))}, tmp_path / "c")
    # A plain tensor inside an object is common state, as Megatron-Core stores it.
    ckptd.save({"w": w, "cfg": _Holder(torch.ones(2))}, tmp_path / "d")


def test_common_state_is_stored_as_megatron_core_stores_it(tmp_path: Path):
    a, b = torch.randn(3), torch.randn(2)
    sd = {
        "layers": [ShardedTensor.from_rank_offsets("layers.a", a)],
        "blocks": {"x": {"w": ShardedTensor.from_rank_offsets("blocks.x.w", b)}},
        "groups": [
            {"lr": 0.1, "w": ShardedObject("g0", 1, (2,), (0,))},
            {"lr": 0.2, "w": ShardedObject("g0", 2, (2,), (1,))},
        ],
        "iteration": 7,
        "empty": {},
        "none": [],
    }
    ckptd.save(sd, tmp_path / "c")
    # Subtrees whose entries were all sharded are left out; no placeholders.
    assert torch.load(tmp_path / "c" / "common.pt", weights_only=True) == {
        "groups": [{"lr": 0.1}, {"lr": 0.2}],
        "iteration": 7,
        "empty": {},
        "none": [],
    }
    out = ckptd.load(
        {
            "layers": [ShardedTensor.from_rank_offsets("layers.a", torch.empty(3))],
            "blocks": {"x": {"w": ShardedTensor.from_rank_offsets("blocks.x.w", torch.empty(2))}},
            "groups": [{"w": ShardedObject("g0", None, (2,), (i,))} for i in range(2)],
        },
        tmp_path / "c",
    )
    assert same_bits(out["layers"][0], a) and same_bits(out["blocks"]["x"]["w"], b)
    assert out["groups"] == [{"lr": 0.1, "w": 1}, {"lr": 0.2, "w": 2}] and out["iteration"] == 7


def test_a_list_mixing_sharded_and_plain_entries_is_refused(tmp_path: Path):
    st = ShardedTensor.from_rank_offsets("a", torch.randn(3))
    with pytest.raises(
        ShardingError,
        match=r"the list at 'layers' mixes sharded, common and local entries "
        r"\(\[0\]: sharded, \[1\]: common\)",
    ):
        ckptd.save({"layers": [st, 5]}, tmp_path / "c")
    with pytest.raises(ShardingError, match=r"the list at 'x' mixes .*\[1\]: local"):
        ckptd.save({"x": [st, ckptd.LocalNonPersistentObject(3)]}, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_dcp_style_state_dict_is_stored_as_dcp_stores_it(tmp_path: Path):
    """Plain tensors and values only: every leaf is an item under DCP's flattened key, so
    torch DCP loads it in place, and ckptd.load fills the given dict in place as DCP does."""
    w, step_t = torch.randn(4, 3), torch.tensor(11.0)
    groups = [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["model.w"]}]
    sd = {
        "model": {"w": w},
        "optim": {"state": {"model.w": {"step": step_t}}, "param_groups": groups},
        "iteration": 5,
        "flags": [True, False],
        "meta": {"x/shard_0_1": 9},
    }
    ckptd.save(sd, tmp_path / "c")
    index = read_index(tmp_path / "c")
    assert sorted(index.tensors) == ["model.w", "optim.state.model.w.step"]
    assert {"iteration", "flags", "meta.x/shard_0_1", "optim.param_groups.0.lr", "optim.param_groups.0.params"} <= set(
        index.objects
    )

    req = {
        "model": {"w": torch.zeros(4, 3)},
        "optim": {
            "state": {"model.w": {"step": torch.tensor(0.0)}},
            "param_groups": [{"lr": 0, "betas": None, "params": None}],
        },
        "iteration": 0,
        "flags": None,
        "meta": {"x/shard_0_1": 0},
    }
    dcp.load(req, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert same_bits(req["model"]["w"], w) and req["optim"]["state"]["model.w"]["step"].item() == 11.0
    assert req["optim"]["param_groups"] == groups and req["iteration"] == 5 and req["flags"] == [True, False]
    assert req["meta"] == {"x/shard_0_1": 9}

    target = torch.zeros(4, 3)
    req2 = {"model": {"w": target}, "iteration": -1, "meta": {"x/shard_0_1": 0}}
    assert ckptd.load(req2, tmp_path / "c") is req2
    assert req2["model"]["w"] is target and same_bits(target, w) and req2["iteration"] == 5
    assert req2["meta"] == {"x/shard_0_1": 9}  # a key that looks like a ShardedObject's is a value
    common = ckptd.load_common_state_dict(tmp_path / "c")
    assert common["optim"]["param_groups"] == groups
    assert common["iteration"] == 5 and common["meta"] == {"x/shard_0_1": 9}


def test_dcp_written_checkpoint_loads_into_a_dcp_style_dict(tmp_path: Path):
    w = torch.randn(5, 2)
    dcp.save(
        {"model": {"w": w}, "step": 3, "sched": {"last": [1, 2]}, "meta": {"x/shard_0_1": 4}},
        checkpoint_id=str(tmp_path / "d"),
        no_dist=True,
    )
    req = {"model": {"w": torch.zeros(5, 2)}, "step": 0, "sched": {"last": None}}
    ckptd.load(req, tmp_path / "d")
    assert same_bits(req["model"]["w"], w) and req["step"] == 3 and req["sched"] == {"last": [1, 2]}
    # A DCP value whose key looks like a ShardedObject's is common state, not dropped.
    assert ckptd.load_common_state_dict(tmp_path / "d")["meta"] == {"x/shard_0_1": 4}


def test_a_request_that_matches_nothing_raises(tmp_path: Path):
    ckptd.save({"w": ShardedTensor.from_rank_offsets("w", torch.randn(3)), "it": 1}, tmp_path / "c")
    with pytest.raises(LoadMismatchError, match="none of the 1 requested entries is in the checkpoint"):
        ckptd.load(
            {"w": ShardedTensor.from_rank_offsets("model.w", torch.empty(3))}, tmp_path / "c", strict="ignore_all"
        )
    with pytest.raises(LoadMismatchError, match="none of the 1 requested"):
        ckptd.load({"model.w": torch.empty(3)}, tmp_path / "c", strict="log_all")


def test_unsafe_pickles_are_decoded_only_when_asked_for(tmp_path: Path):
    w = torch.randn(3)
    dcp.save({"w": w, "blob": io.BytesIO(b"abc"), "step": 2}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(3))}, tmp_path / "d")
    assert same_bits(out["w"], w) and "blob" not in out
    req = {"w": torch.empty(3), "step": 0}
    ckptd.load(req, tmp_path / "d")
    assert req["step"] == 2
    with pytest.raises(UnsafePickleError, match="blob"):
        ckptd.load({"w": torch.empty(3), "blob": None}, tmp_path / "d")
    req = {"w": torch.empty(3), "blob": None}
    ckptd.load(req, tmp_path / "d", allow_unsafe_pickle=True)
    assert req["blob"].getvalue() == b"abc"
    assert same_bits(ckptd.load_plain_tensors(tmp_path / "d")["w"], w)
    assert same_bits(ckptd.load_plain_tensors(tmp_path / "d", allow_unsafe_pickle=True)["w"], w)
    # Consolidation: tensors alone need no opt-in; the common state needs it and gets it.
    from ckptd.convert import consolidate

    assert same_bits(consolidate(tmp_path / "d", tmp_path / "m.pt", fsync=False)["w"], w)
    with pytest.raises(UnsafePickleError):
        consolidate(tmp_path / "d", tmp_path / "m.pt", include_common=True, fsync=False)
    out = consolidate(tmp_path / "d", tmp_path / "m.pt", include_common=True, allow_unsafe_pickle=True, fsync=False)
    assert out["common"]["blob"].getvalue() == b"abc" and out["common"]["step"] == 2
    # The same in common.pt: a tensor-only load and load_plain_tensors do not decode it.
    ckptd.save({"w": ShardedTensor.from_rank_offsets("w", w), "blob": io.BytesIO(b"x")}, tmp_path / "c")
    assert same_bits(ckptd.load_plain_tensors(tmp_path / "c")["w"], w)
    with pytest.raises(UnsafePickleError):
        ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(3))}, tmp_path / "c")


@pytest.mark.parametrize("mode", ["raise_all", "return_all"])
def test_strict_all_modes_do_not_count_common_values_as_missing(tmp_path: Path, mode):
    w, v = torch.randn(3), torch.randn(2)
    dcp.save({"w": w, "v": v, "step": 3, "opt": {"lr": 0.1}}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    req = {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(3)),
        "v": ShardedTensor.from_rank_offsets("v", torch.empty(2)),
    }
    out = ckptd.load(req, tmp_path / "d", strict=mode)
    if mode == "return_all":
        out, missing, unexpected = out
        assert missing == set() and unexpected == set()
    assert same_bits(out["w"], w) and same_bits(out["v"], v)
    del req["v"]
    if mode == "raise_all":
        with pytest.raises(LoadMismatchError, match=r"requested by no rank \(missing\): \['v'\]"):
            ckptd.load(req, tmp_path / "d", strict=mode)
    else:
        assert ckptd.load(req, tmp_path / "d", strict=mode)[1] == {"v"}


def test_two_values_with_one_flattened_key_are_refused(tmp_path: Path):
    with pytest.raises(ShardingError, match="two values of the state dict flatten to the key 'a.b'"):
        ckptd.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "c")


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(()), torch.zeros(0), torch.arange(6.0).reshape(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16).t()],
)
def test_a_whole_plain_tensor_is_the_unsharded_chunk_from_rank_offsets_builds(tensor):
    """ShardedTensor.whole skips the checks that hold by construction; it must build exactly what
    from_rank_offsets(key, tensor) builds (scalars, empty and non-contiguous tensors too)."""
    fast, checked = ShardedTensor.whole("k", tensor), ShardedTensor.from_rank_offsets("k", tensor)
    assert fast.data is tensor
    assert vars(fast).keys() == vars(checked).keys()
    assert fast.without_data() == checked.without_data()
    fast.validate_metadata_integrity()
