"""A repeated save's plan (ckptd.format.repeat) is the full plan, item for item, or no plan at all.

Each case plans a state dict the full way, remembers it, changes the state dict, and compares
RepeatPlan.plan with the full plan of the changed dict: the same records, the same payload objects
(tensors) or bytes (values), the same placements and held keys; or None where the change needs
the full way. A random walk over structures and changes does the same at scale.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import torch

from ckptd import ShardedTensor
from ckptd.format.repeat import PlannedSave, RepeatPlan
from ckptd.format.saveplan import PlanCache, plan_rank
from ckptd.staging.rankside import place
from ckptd.statedict.holdings import PlainWriters
from ckptd.statedict.split import split_state_dict


def _full(sd: dict[str, Any], skip: frozenset[str] = frozenset()) -> tuple[Any, Any, Any, Any]:
    split = split_state_dict(sd)
    plan = plan_rank(split, 0, PlanCache(), skip=skip)
    placements, nbytes = place(plan.items)
    return split, plan, placements, nbytes


def _remembered(sd: dict[str, Any], skip: frozenset[str] = frozenset()) -> RepeatPlan:
    split, plan, placements, nbytes = _full(sd, skip)
    saved = PlannedSave(
        items=plan.items,
        placements=placements,
        nbytes=nbytes,
        held=plan.held,
        plain="d",
        skip=skip,
        common=None,
        common_digest="",
    )
    rp = RepeatPlan()
    rp.remember(sd, split, plan, saved)
    return rp


def _plan(rp: RepeatPlan, sd: dict[str, Any], rank: int) -> PlannedSave | None:
    return rp.plan(sd, rank, place)


def _same_as_full(rp: RepeatPlan, sd: dict[str, Any], skip: frozenset[str] = frozenset()) -> bool | None:
    """None where the repeat plan declines; else whether it equals the full plan of ``sd``."""
    got = _plan(rp, sd, 0)
    if got is None:
        return None
    _, plan, placements, nbytes = _full(sd, skip)
    if [i.record for i in got.items] != [i.record for i in plan.items] or got.held != plan.held:
        return False
    for a, b in zip(got.items, plan.items):
        if isinstance(b.payload, torch.Tensor):
            if a.payload is not b.payload:
                return False
        elif a.payload != b.payload:
            return False
    if got.placements != placements or got.nbytes != nbytes:
        return False
    return got.skip == skip and got.plain == "d"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g), "n": torch.tensor(7)},
        "optim": {
            "state": {"w": {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(2.0)}},
            "param_groups": [{"lr": 0.001, "betas": (0.9, 0.99), "params": ["w", "b"]}],
        },
        "step": 5,
        "layers": [{"k": torch.ones(2)}, {"k": torch.ones(2)}],
        "note": None,
        "name": "run",
    }


def test_the_same_structure_again_is_planned_as_the_full_way_does_with_the_new_tensors():
    sd = _state()
    rp = _remembered(sd)
    again = _state()  # new tensors, equal structure and values
    assert _same_as_full(rp, again) is True
    assert _plan(rp, again, 0).placements is _plan(rp, _state(), 0).placements  # not placed again


def test_the_remembered_plan_holds_no_tensor_of_the_save_it_came_from():
    import gc
    import weakref

    sd = _state()
    rp = _remembered(sd)
    gone = weakref.ref(sd["model"]["w"])
    del sd
    gc.collect()
    assert gone() is None  # a state built anew for each save is freed after it
    assert _same_as_full(rp, _state()) is True


def test_a_changed_plain_value_is_serialized_again():
    rp = _remembered(_state())
    sd = _state()
    sd["optim"]["param_groups"][0]["lr"] = 0.0005
    sd["name"] = "x" * 1000  # a longer pickle: the items are placed again
    assert _same_as_full(rp, sd) is True  # placed again: the same placements as the full plan's


def _changes() -> dict[str, Any]:
    def dtype(sd):
        sd["model"]["w"] = sd["model"]["w"].double()

    def shape(sd):
        sd["model"]["b"] = torch.zeros(4)

    def rename(sd):
        sd["model"]["bb"] = sd["model"].pop("b")

    def reorder(sd):
        sd["model"] = dict(reversed(list(sd["model"].items())))

    def int_key(sd):
        sd["extra"] = {1: torch.zeros(1)}

    def subclass(sd):
        sd["model"]["w"] = torch.nn.Parameter(sd["model"]["w"])

    def tensor_to_value(sd):
        sd["model"]["n"] = 7

    def value_to_tensor(sd):
        sd["step"] = torch.tensor(5)

    def list_longer(sd):
        sd["layers"].append({"k": torch.ones(2)})

    def device(sd):
        sd["model"]["n"] = torch.tensor(7, device="meta")

    def sharded(sd):
        sd["model"]["w"] = ShardedTensor.from_rank_offsets("w", sd["model"]["w"])

    def unpicklable(sd):
        sd["note"] = object()

    return {
        f.__name__: f
        for f in (
            dtype,
            shape,
            rename,
            reorder,
            int_key,
            subclass,
            tensor_to_value,
            value_to_tensor,
            list_longer,
            device,
            sharded,
            unpicklable,
        )
    }


def test_every_other_change_takes_the_full_way():
    for name, change in _changes().items():
        rp = _remembered(_state())
        sd = _state()
        change(sd)
        assert _plan(rp, sd, 0) is None, name


def test_keys_equal_as_values_but_not_as_dcp_keys_differ():
    rp = _remembered({"a": {1: torch.zeros(2)}})
    assert _plan(rp, {"a": {True: torch.zeros(2)}}, 0) is None  # 1 == True, but 'a.1' != 'a.True'
    assert _same_as_full(rp, {"a": {1: torch.ones(2)}}) is True


def test_a_leaf_moved_between_containers_is_another_structure():
    """Same keys, same leaf count and order, another nesting: the prefix code tells them apart."""
    a = {"x": [{"p": torch.zeros(1)}, {"q": torch.zeros(1)}], "y": torch.zeros(1)}
    b = {"x": [{"p": torch.zeros(1)}], "y": [{"q": torch.zeros(1)}, torch.zeros(1)]}
    rp = _remembered(a)
    assert _plan(rp, b, 0) is None


def test_plain_items_left_to_other_ranks_are_remembered_with_their_assignment():
    sd = _state()
    skip = frozenset({"model.b", "step"})
    rp = _remembered(sd, skip)
    assert _same_as_full(rp, _state(), skip) is True
    writers = PlainWriters()
    assert writers.known_skip("", 0, 2) == frozenset()
    writers.confirmed = "d"
    assert writers.known_skip("d", 0, 2) is None  # needs a split to decide: the full way


def test_a_value_left_to_another_rank_is_checked_as_the_full_way_would():
    """Ranks other than the writer store no item of a plain value, but the full way would still
    refuse, or shard, what a list or tuple there holds now."""
    from ckptd import ShardedObject

    sd = {"w": torch.zeros(2), "sched": (1, 2), "extra": [1]}
    skip = frozenset({"w", "sched", "extra"})
    rp = _remembered(sd, skip)
    assert _same_as_full(rp, {"w": torch.zeros(2), "sched": (3, 4), "extra": [5]}, skip) is True
    assert _plan(rp, {"w": torch.zeros(2), "sched": (1, torch.zeros(1)), "extra": [1]}, 0) is None
    obj = ShardedObject("obj", {"a": 1}, (1,), (0,))
    assert _plan(rp, {"w": torch.zeros(2), "sched": (1, 2), "extra": [obj]}, 0) is None


def test_keys_that_print_otherwise_than_they_compare_are_planned_the_full_way():
    for sd in ({0.0: torch.zeros(1), "b": 1}, {"m": {(1, 2): torch.zeros(1)}}):
        rp = _remembered(sd)
        assert _plan(rp, copy.copy(sd), 0) is None  # -0.0 == 0.0 and (1.0, 2) == (1, 2), as keys too


def test_what_is_not_a_dict_is_left_to_the_full_way_and_its_error():
    rp = _remembered(_state())
    assert _plan(rp, [1, 2], 0) is None and _plan(rp, None, 0) is None


def test_no_template_for_what_the_repeat_plan_cannot_reproduce():
    for sd in (
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))},  # Megatron-style
        {"w": torch.zeros(2), "o": object()},  # a value that is not a plain Python value
        {"w": torch.nn.Parameter(torch.zeros(2))},  # a tensor subclass
    ):
        rp = _remembered(sd)
        assert _plan(rp, copy.copy(sd), 0) is None


def _random_tree(rnd: random.Random, depth: int = 0) -> Any:
    r = rnd.random()
    if depth < 3 and r < 0.35:
        return {rnd.choice(["a", "b", "c", "d", 1, 2]): _random_tree(rnd, depth + 1) for _ in range(rnd.randint(0, 3))}
    if depth < 3 and r < 0.5:
        return [_random_tree(rnd, depth + 1) for _ in range(rnd.randint(1, 3))]
    if r < 0.8:
        return torch.zeros(rnd.choice([(), (2,), (2, 3)]), dtype=rnd.choice([torch.float32, torch.int64]))
    return rnd.choice([1, 2.5, "s", None, True, [1, 2], (3, "x"), {"k": 1}])


def _mutate(rnd: random.Random, x: Any) -> Any:
    """A copy of ``x`` (new tensors), sometimes with one leaf or container changed."""
    if isinstance(x, dict):
        items = [(k, _mutate(rnd, v)) for k, v in x.items()]
        if rnd.random() < 0.05:
            rnd.shuffle(items)
        return dict(items)
    if isinstance(x, list):
        out = [_mutate(rnd, v) for v in x]
        if rnd.random() < 0.05:
            out.append(torch.zeros(2))
        return out
    if isinstance(x, torch.Tensor):
        r = rnd.random()
        if r < 0.05:
            return torch.zeros(x.shape, dtype=torch.float64)
        if r < 0.1:
            return 3
        return x.clone()
    if rnd.random() < 0.1:
        return rnd.choice([7, "t", 2.5, torch.zeros(1)])
    return copy.deepcopy(x)


def test_random_structures_and_changes_plan_as_the_full_way_or_not_at_all():
    rnd = random.Random(1234)
    compared = declined = 0
    for _ in range(400):
        sd = {"root": _random_tree(rnd)}
        try:
            _full(sd)
        except Exception:  # noqa: BLE001 - a structure the full way refuses is no template
            continue
        rp = _remembered(sd)
        for _ in range(3):
            changed = _mutate(rnd, sd)
            try:
                _full(changed)
            except Exception:  # noqa: BLE001
                assert _plan(rp, changed, 0) is None
                continue
            same = _same_as_full(rp, changed)
            assert same is not False, changed
            compared += same is True
            declined += same is None
    assert compared > 100 and declined > 20  # both ways taken often
