"""What ckptd.optim is handed: the part of a load result restore_optimizer_state reads, and the
model sharded state dicts param_shardings finds the parameters in (Megatron-Core's classes,
factories)."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd import LoadMismatchError, ShardedTensor, ShardingError
from ckptd.mapping import ShardedTensorFactory
from ckptd.optim import optimizer_load_template, param_shardings, restore_optimizer_state, sharded_optimizer_state
from tools.harness.ranks import run_ranks


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


# Megatron-Core is imported in spawned processes only: importing it registers torch.load safe
# globals (argparse.Namespace) that would change what other tests of this worker see.
def _mcore_round_trip(rank: int, world: int, root: str) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MST  # noqa: N814 - Megatron's class

    lin, opt = _stepped(0, 0.1)
    msd = {"w": MST.from_rank_offsets("w", lin.weight), "b": MST.from_rank_offsets("b", lin.bias)}
    sh = param_shardings(opt, msd)
    assert [(type(s), s.key, s.data is p) for s, p in zip(sh, (lin.weight, lin.bias))] == [
        (ShardedTensor, "w", True),
        (ShardedTensor, "b", True),
    ]
    ckptd.save({"model": msd, "optimizer": sharded_optimizer_state(opt, sh)}, f"{root}/c")
    lin2, opt2 = _stepped(1, 0.5)
    msd2 = {"w": MST.from_rank_offsets("w", lin2.weight), "b": MST.from_rank_offsets("b", lin2.bias)}
    sh2 = param_shardings(opt2, msd2)
    loaded = ckptd.load({"optimizer": optimizer_load_template(opt2, sh2, f"{root}/c")}, f"{root}/c")
    restore_optimizer_state(opt2, loaded["optimizer"], sh2)
    for p, p2 in ((lin.weight, lin2.weight), (lin.bias, lin2.bias)):
        assert all(torch.equal(opt2.state[p2][k], v) for k, v in opt.state[p].items())


@pytest.mark.timeout(120)
def test_megatron_core_sharded_tensors_wrapping_the_parameters_are_found(tmp_path):
    """They were taken for no wrapper at all ("not wrapped by any ShardedTensor ... pass the
    shardings explicitly"), though every other entry point of ckptd adopts them."""
    run_ranks(_mcore_round_trip, 1, str(tmp_path), timeout_s=90)


def _fc1() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    fc1 = torch.nn.Linear(4, 8, bias=False)
    return fc1, torch.optim.Adam(fc1.parameters())


def _mcore_factory_refusal(rank: int, world: int) -> str:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as MST  # noqa: N814 - Megatron's class
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    fc1, opt = _fc1()
    factory = apply_swiglu_sharded_factory(MST.from_rank_offsets("fc1", fc1.weight, (0, 1, 2)), ())
    try:
        param_shardings(opt, {"mlp": {"linear_fc1": factory}})
    except ShardingError as exc:
        return str(exc)
    return "not refused"


def _ckptd_factory_refusal() -> str:
    fc1, opt = _fc1()

    def build(key: str, t: torch.Tensor, replica_id: object, flattened_range: object) -> list[ShardedTensor]:
        gate, up = torch.chunk(t, 2)
        return [
            ShardedTensor.from_rank_offsets(key, gate, (0, 1, 4)),
            ShardedTensor.from_rank_offsets(key, up, (0, 3, 4)),
        ]

    with pytest.raises(ShardingError) as err:
        param_shardings(opt, {"mlp": {"linear_fc1": ShardedTensorFactory("fc1", fc1.weight, build, torch.cat)}})
    return str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("library", ["megatron", "ckptd"])
def test_a_parameter_only_a_factory_wraps_is_refused_saying_why_and_what_to_do(library):
    """A gated linear unit's fc1 at TP 2, rank 1: its rows are [gate_1; up_1], two pieces of the
    global [gate; up] that Megatron-Core's factory builds. It was reported as wrapped by nothing,
    with the advice to pass shardings by hand, which (one row split) would store the moments in
    this rank's row order, loading back right only at TP 2."""
    if library == "megatron":
        message = run_ranks(_mcore_factory_refusal, 1, timeout_s=90)[0]
    else:
        message = _ckptd_factory_refusal()
    assert "wrapped by the ShardedTensorFactory 'fc1' at 'mlp.linear_fc1'" in message
    assert "no single sharding describes" in message
    assert "loads back only at the same tensor-parallel size" in message
    assert "optimizer sharded_state_dict(model_sharded_state_dict)" in message
    assert "pass the shardings explicitly" not in message
