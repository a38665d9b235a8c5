"""``ckptd bench train``'s bit-exact check can fail: a load that writes nothing (or the live state
loaded into itself) is caught, for the flat workload's ShardedTensors and the GPT's state dict,
and the flat workload's update does not undo itself (a negation gave the saved values back after
an even number of steps). Pure: no daemon, no process group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.train import SIZES, GptWorkload, flat_workload, load_template, loaded_differs
from benchmarks.trainloop import Workload, tensors_of


def _workload(name: str) -> Workload:
    if name == "flat":
        return flat_workload(0, 8 << 20, 16)
    return GptWorkload(0, "cpu", SIZES["cpu"])


def _saved_then_trained(w: Workload, steps: int = 4) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """As ``bit_exact``: the state and copies of its tensors at a save, then ``steps`` more steps."""
    w.compute()
    w.update()
    state = w.state(2)
    ref = {k: v.detach().to("cpu", copy=True) for k, v in tensors_of(state).items()}
    for _ in range(steps):
        w.compute()
        w.update()
    return ref, state


@pytest.mark.parametrize("name", ["flat", "gpt"])
def test_a_load_that_writes_nothing_fails_the_check(name: str) -> None:
    ref, state = _saved_then_trained(_workload(name))
    assert ref
    assert sorted(loaded_differs(ref, state, lambda template: template)) == sorted(ref)


@pytest.mark.parametrize("name", ["flat", "gpt"])
def test_a_load_that_writes_the_saved_values_passes_it(name: str) -> None:
    ref, state = _saved_then_trained(_workload(name))

    def load(template: Any) -> Any:
        for k, t in tensors_of(template).items():
            t.copy_(ref[k])
        return template

    assert loaded_differs(ref, state, load) == []


def test_the_template_of_sharded_tensors_is_new_objects_over_new_data() -> None:
    state = _workload("flat").state(0)
    live = {k: v.clone() for k, v in tensors_of(state).items()}
    template = load_template(state)
    for k, st in state.items():
        assert template[k] is not st and template[k].key == st.key
        assert template[k].data.data_ptr() != st.data.data_ptr()
    assert all(torch.equal(v, live[k]) for k, v in tensors_of(state).items())  # the live state untouched


def test_the_flat_update_moves_the_state_on_every_step() -> None:
    w = _workload("flat")
    before = {k: v.clone() for k, v in tensors_of(w.state(0)).items()}
    for steps in (1, 2):
        w.update()
        after = tensors_of(w.state(0))
        assert all(not torch.equal(after[k], v) for k, v in before.items()), steps
