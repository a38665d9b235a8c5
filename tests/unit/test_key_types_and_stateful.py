"""Single-process cases of two load rules: dict keys come back with their types (Megatron-Core's
distributed optimizer keys by ints, strs and dtype tuples), and top-level Stateful objects are
saved and loaded as torch DCP does. The multi-rank cases: tests/real/test_megatron_distopt.py,
tests/integration/test_stateful.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd import LocalNonPersistentObject, ShardedObject, ShardedTensor
from ckptd.statedict.tree import set_path

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _optimizer_like(fill: float) -> dict:
    """The shape of Megatron-Core's dp_reshardable optimizer state: every entry of ``param_state``
    sharded, keyed by an int, strs and a tuple of dtypes."""
    bucket = {
        "param": ShardedTensor.from_rank_offsets("b.param", torch.full((4,), fill)),
        "exp_avg": ShardedTensor.from_rank_offsets("b.exp_avg", torch.full((4,), fill + 1)),
        "padding": LocalNonPersistentObject(False),
    }
    return {
        "optimizer": {
            "param_state": {
                0: {(torch.float32, torch.float32): [[bucket]]},
                "per_bucket_numel": ShardedObject("pbn", [4], (1,), (0,)),
            },
            "param_state_sharding_type": "dp_reshardable",
        },
        "by_layer": {0: ShardedTensor.from_rank_offsets("l0", torch.full((2,), fill)), 1: LocalNonPersistentObject(1)},
    }


def test_dict_keys_come_back_with_their_types(tmp_path: Path):
    ckptd.save(_optimizer_like(1.0), tmp_path / "c")
    out = ckptd.load(_optimizer_like(0.0), tmp_path / "c")
    param_state = out["optimizer"]["param_state"]
    assert list(param_state) == [0, "per_bucket_numel"] and param_state["per_bucket_numel"] == [4]
    (bucket,) = param_state[0][(torch.float32, torch.float32)][0]
    assert torch.equal(bucket["param"], torch.full((4,), 1.0)) and bucket["padding"] is False
    assert isinstance(out["by_layer"], dict) and list(out["by_layer"]) == [0, 1]  # not a list
    assert out["optimizer"]["param_state_sharding_type"] == "dp_reshardable"


def test_set_path_makes_containers_like_the_request_and_refuses_what_does_not_fit():
    root: dict = {}
    set_path(root, ("a", 0, "x"), 1, {"a": {0: {"x": None}}})
    set_path(root, ("b", 0), 2)  # no request: an int makes a list
    assert root == {"a": {0: {"x": 1}}, "b": [2]}
    with pytest.raises(ValueError, match="'b' is a list, which has no entry 'k'"):
        set_path(root, ("b", "k"), 3)
    with pytest.raises(ValueError, match="'a.0.x' holds a int"):
        set_path(root, ("a", 0, "x", "y"), 3)


class _Counter:
    """A Stateful (state_dict / load_state_dict) that is not a dict."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.weights = torch.full((3,), float(n))
        self.loads = 0

    def state_dict(self) -> dict:
        return {"n": self.n, "weights": self.weights}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]
        self.weights = sd["weights"]
        self.loads += 1


def test_top_level_stateful_objects_save_their_state_dict_and_load_into_the_live_object(tmp_path: Path):
    model = torch.nn.Linear(2, 3)
    ckptd.save({"counter": _Counter(5), "model": model, "step": 9}, tmp_path / "c")
    fresh, fresh_model = _Counter(0), torch.nn.Linear(2, 3)
    request = {"counter": fresh, "model": fresh_model, "step": 0}
    assert ckptd.load(request, tmp_path / "c") is request
    assert request["counter"] is fresh and request["model"] is fresh_model and request["step"] == 9
    assert fresh.loads == 1 and fresh.n == 5 and torch.equal(fresh.weights, torch.full((3,), 5.0))
    assert torch.equal(fresh_model.weight, model.weight) and torch.equal(fresh_model.bias, model.bias)
    # Stored as DCP stores it: DCP loads it into its own Stateful objects, and ckptd DCP's.
    other = _Counter(0)
    dcp.load({"counter": other}, checkpoint_id=str(tmp_path / "c"))
    assert other.n == 5 and other.loads == 1
    dcp.save({"counter": _Counter(7)}, checkpoint_id=str(tmp_path / "d"))
    back = _Counter(0)
    ckptd.load({"counter": back}, tmp_path / "d")
    assert back.n == 7 and back.loads == 1


def test_stateful_objects_in_megatron_style_and_strict_modes(tmp_path: Path):
    w = ShardedTensor.from_rank_offsets("w", torch.ones(2))
    ckptd.save({"w": w, "counter": _Counter(3)}, tmp_path / "c")
    fresh = _Counter(0)
    out = ckptd.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2)), "counter": fresh}, tmp_path / "c")
    assert out["counter"] is fresh and fresh.n == 3 and fresh.loads == 1
    fresh = _Counter(0)
    out, missing, unexpected = ckptd.load({"counter": fresh}, tmp_path / "c", strict="return_all")
    assert out["counter"] is fresh and fresh.n == 3 and missing == {"w"} and not unexpected
