"""What ckptd.optim is handed: the part of a load result restore_optimizer_state reads, and the
model sharded state dicts param_shardings finds the parameters in (Megatron-Core's classes)."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd import LoadMismatchError, ShardedTensor
from ckptd.optim import optimizer_load_template, param_shardings, restore_optimizer_state, sharded_optimizer_state


def _stepped(seed: int, lr: float) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=lr)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    return lin, opt


def _model_sd(lin: torch.nn.Linear) -> dict[str, ShardedTensor]:
    return {"w": ShardedTensor.from_rank_offsets("w", lin.weight), "b": ShardedTensor.from_rank_offsets("b", lin.bias)}


def test_the_whole_load_result_is_refused_rather_than_wiping_every_parameters_state(tmp_path):
    """Given ``{"model": ..., "optimizer": ...}`` instead of its optimizer part, the restore found
    no state in it and loaded an empty one: the Adam moments and step of every parameter were
    gone, and the live learning rate kept, silently."""
    lin, opt = _stepped(0, 0.1)
    sh = param_shardings(opt, _model_sd(lin))
    ckptd.save({"model": _model_sd(lin), "optimizer": sharded_optimizer_state(opt, sh)}, tmp_path / "c")
    lin2, opt2 = _stepped(1, 0.5)
    sh2 = param_shardings(opt2, _model_sd(lin2))
    request = {"model": _model_sd(lin2), "optimizer": optimizer_load_template(opt2, sh2, tmp_path / "c")}
    loaded = ckptd.load(request, tmp_path / "c")
    with pytest.raises(LoadMismatchError, match=r"the keys 'model', 'optimizer' and none of .*'state'.*whole result"):
        restore_optimizer_state(opt2, loaded, sh2)
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in opt2.state.values())  # untouched
    assert opt2.param_groups[0]["lr"] == 0.5
    # The optimizer's part restores; {} (a template of only new keys, left out of the result) too.
    restore_optimizer_state(opt2, loaded["optimizer"], sh2)
    assert opt2.param_groups[0]["lr"] == 0.1
    assert torch.equal(opt2.state[lin2.weight]["exp_avg"], opt.state[lin.weight]["exp_avg"])
    restore_optimizer_state(opt2, {}, sh2)
