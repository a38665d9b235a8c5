"""Optimizer group hyper-parameters and parameters the checkpoint's optimizer did not hold
(ckptd.optim): restored by parameter key, and refused rather than resumed without state. The
pipeline case (each stage its own groups) runs on two ranks below."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import LoadMismatchError, ShardedTensor
from ckptd.optim import optimizer_load_template, param_shardings, restore_optimizer_state, sharded_optimizer_state
from tools.harness.ranks import run_ranks


def _params() -> tuple[dict[str, torch.nn.Parameter], dict[str, ShardedTensor]]:
    g = torch.Generator().manual_seed(1)
    ps = {k: torch.nn.Parameter(torch.randn(4, generator=g)) for k in "abc"}
    return ps, {k: ShardedTensor.from_rank_offsets(k, p.data) for k, p in ps.items()}


def _save(root: Path) -> None:
    ps, msd = _params()
    opt = torch.optim.AdamW(
        [
            {"params": [ps["a"], ps["c"]], "weight_decay": 0.1, "lr": 1e-3},
            {"params": [ps["b"]], "weight_decay": 0.0, "lr": 5e-4},
        ]
    )
    for p in ps.values():
        p.grad = torch.ones(4)
    opt.step()
    ckptd.save({"model": msd, "optimizer": sharded_optimizer_state(opt, param_shardings(opt, msd))}, root)


def test_groups_listed_in_another_order_get_the_hyperparameters_their_parameters_were_saved_with(tmp_path):
    """Matched by position, the no-decay group got weight decay 0.1 and the decay group none."""
    _save(tmp_path / "c")
    ps, msd = _params()
    opt = torch.optim.AdamW([{"params": [ps["b"]]}, {"params": [ps["a"], ps["c"]]}], lr=0.5, weight_decay=0.5)
    sh = param_shardings(opt, msd)
    loaded = ckptd.load({"model": msd, "optimizer": optimizer_load_template(opt, sh, tmp_path / "c")}, tmp_path / "c")
    restore_optimizer_state(opt, loaded["optimizer"], sh)
    assert [(g["weight_decay"], g["lr"]) for g in opt.param_groups] == [(0.0, 5e-4), (0.1, 1e-3)]
    assert all(float(opt.state[p]["step"]) == 1.0 for p in ps.values())
    # Parameters saved in groups of different hyper-parameters, now in one group: refused.
    ps, msd = _params()
    opt = torch.optim.AdamW(list(ps.values()))
    sh = param_shardings(opt, msd)
    loaded = ckptd.load({"model": msd, "optimizer": optimizer_load_template(opt, sh, tmp_path / "c")}, tmp_path / "c")
    with pytest.raises(LoadMismatchError, match="groups of different hyper-parameters"):
        restore_optimizer_state(opt, loaded["optimizer"], sh)


def test_a_parameter_whose_key_the_saved_optimizer_did_not_hold_is_refused_not_resumed_without_state(tmp_path):
    _save(tmp_path / "c")
    ckptd.save({"model": _params()[1]}, tmp_path / "model_only")
    new = torch.nn.Parameter(torch.zeros(4))
    ps, msd = _params()
    msd["d"] = ShardedTensor.from_rank_offsets("d", new.data)  # a new head (or a renamed key)
    opt = torch.optim.AdamW([{"params": [ps["a"], ps["c"]]}, {"params": [ps["b"]]}, {"params": [new], "lr": 0.7}])
    sh = param_shardings(opt, msd)
    with pytest.raises(LoadMismatchError, match=r"no optimizer state of 'd' under 'optimizer'"):
        optimizer_load_template(opt, sh, tmp_path / "c")
    template = optimizer_load_template(opt, sh, tmp_path / "c", allow_missing=True)  # it starts fresh
    loaded = ckptd.load({"optimizer": template}, tmp_path / "c")
    restore_optimizer_state(opt, loaded["optimizer"], sh)
    assert new not in opt.state and float(opt.state[ps["a"]]["step"]) == 1.0
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 5e-4, 0.7]  # the new group keeps its own
    with pytest.raises(LoadMismatchError, match=r"no optimizer state of 'a', 'b', 'c', 'd'"):
        optimizer_load_template(opt, sh, tmp_path / "model_only")
    # Also where the common state holds what a weights-only load refuses (Megatron-LM's args): its
    # pickle is searched, never run (it was taken for one holding an optimizer).
    import argparse

    ckptd.save({"model": _params()[1], "args": argparse.Namespace(lr=0.1)}, tmp_path / "megatron_model_only")
    with pytest.raises(LoadMismatchError, match=r"no optimizer state of 'a', 'b', 'c', 'd'"):
        optimizer_load_template(opt, sh, tmp_path / "megatron_model_only")


def _stage(rank: int, world: int, root: str) -> dict:
    """Pipeline stage ``rank``: its own layer, learning rate and betas."""
    key = f"layers.{rank}.w"

    def build() -> tuple[torch.nn.Parameter, torch.optim.Optimizer, dict]:
        p = torch.nn.Parameter(torch.ones(3) * (rank + 1))
        hyper = {"lr": [1e-3, 4e-3][rank], "weight_decay": [0.1, 0.0][rank], "betas": [(0.9, 0.95), (0.8, 0.99)][rank]}
        return p, torch.optim.AdamW([{"params": [p], **hyper}]), {key: ShardedTensor.from_rank_offsets(key, p.data)}

    p, opt, msd = build()
    p.grad = torch.ones(3)
    opt.step()
    ckptd.save({"model": msd, "optimizer": sharded_optimizer_state(opt, param_shardings(opt, msd))}, f"{root}/pp")
    p, opt, msd = build()
    opt.param_groups[0].update(lr=9.0, weight_decay=9.0, betas=(0.1, 0.1))  # a fresh optimizer's defaults
    sh = param_shardings(opt, msd)
    loaded = ckptd.load({"optimizer": optimizer_load_template(opt, sh, f"{root}/pp")}, f"{root}/pp")
    restore_optimizer_state(opt, loaded["optimizer"], sh)
    g = opt.param_groups[0]
    return {"lr": g["lr"], "weight_decay": g["weight_decay"], "betas": tuple(g["betas"])}


@pytest.mark.timeout(120)
def test_each_pipeline_stage_gets_its_own_groups_hyperparameters(tmp_path):
    """Every rank got rank 0's groups (they were rank 0's common state)."""
    assert run_ranks(_stage, 2, str(tmp_path), timeout_s=90) == [
        {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        {"lr": 4e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
    ]


def test_an_earlier_ckptds_optimizer_without_state_is_restored_as_before(tmp_path):
    """A checkpoint of an earlier ckptd (no per-key groups: a ``param_groups`` list) whose optimizer
    held no state (SGD without momentum) is not taken for one without an optimizer."""
    ps, msd = _params()
    opt = torch.optim.SGD(list(ps.values()), lr=0.3)
    sd = sharded_optimizer_state(opt, param_shardings(opt, msd))
    del sd["groups"]
    sd["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]
    # A large value first in the common state (it hid the groups from a bounded walk of it).
    ckptd.save({"data": {"consumed": list(range(20000))}, "model": msd, "optimizer": sd}, tmp_path / "c")
    ps, msd = _params()
    opt = torch.optim.SGD(list(ps.values()), lr=0.9)
    sh = param_shardings(opt, msd)
    loaded = ckptd.load({"model": msd, "optimizer": optimizer_load_template(opt, sh, tmp_path / "c")}, tmp_path / "c")
    restore_optimizer_state(opt, loaded["optimizer"], sh)
    assert opt.param_groups[0]["lr"] == 0.3


def test_hyperparameters_equal_as_values_are_one_group():
    from ckptd.optim import _same_hyper

    assert _same_hyper({"betas": [0.9, 0.95], "lr": float("nan")}, {"betas": (0.9, 0.95), "lr": float("nan")})
    assert _same_hyper((torch.tensor([0.9, 0.99]),), (torch.tensor([0.9, 0.99]),))
    assert not _same_hyper({"lr": 0.1}, {"lr": 0.2}) and not _same_hyper({"lr": 0.1}, {"lr": 0.1, "wd": 0})


def test_shards_of_one_key_in_groups_of_different_hyperparameters_are_refused_at_save():
    """Two local experts of one key with their own learning rates: the key stores one set, and the
    second resumed with the first's, silently."""
    from ckptd import ShardingError

    e0, e1 = torch.nn.Parameter(torch.ones(1, 4)), torch.nn.Parameter(torch.ones(1, 4))
    shardings = [ShardedTensor.from_rank_offsets("exp", e.data, (0, i, 2)) for i, e in enumerate((e0, e1))]
    opt = torch.optim.AdamW([{"params": [e0], "lr": 0.1}, {"params": [e1], "lr": 0.5}])
    with pytest.raises(ShardingError, match=r"shards of 'exp' .* groups of different hyper-parameters"):
        sharded_optimizer_state(opt, shardings)
