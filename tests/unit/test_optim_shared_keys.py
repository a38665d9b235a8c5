"""Optimizer state of several parameters that are shards of one key on one rank (one process).

Megatron-Core's local experts share one checkpoint key on a prepended expert axis; a distributed
optimizer may hold two flat ranges of one tensor. Each parameter's state must be stored and
restored as the shard of the key at that parameter's offset, whatever the layout on either side
(one parameter holding every expert, one parameter per expert in any optimizer order), and a
``step`` the shards disagree on must be refused at save, not stored from one of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import ShardingError
from ckptd.optim import optimizer_load_template, restore_optimizer_state, sharded_optimizer_state

KEY = "decoder.mlp.experts.fc1.weight"
EXPERTS, SHAPE = 4, (3, 2)
MOMENTS = ("exp_avg", "exp_avg_sq")


def initial() -> torch.Tensor:
    return torch.randn((EXPERTS, *SHAPE), generator=torch.Generator().manual_seed(7))


def grad(step: int) -> torch.Tensor:
    return torch.randn((EXPERTS, *SHAPE), generator=torch.Generator().manual_seed(100 + step))


class Whole:
    """One parameter holding every expert (a grouped GEMM's weight, or a converted checkpoint)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.p = torch.nn.Parameter(value.clone())
        self.opt = torch.optim.Adam([self.p], lr=1e-2)
        self.shardings = [ShardedTensor.from_rank_offsets(KEY, self.p.data)]

    def steps(self, first: int, count: int) -> None:
        for step in range(first, first + count):
            self.p.grad = grad(step)
            self.opt.step()

    def state(self, name: str) -> torch.Tensor:
        return self.opt.state[self.p][name]


class Experts:
    """One parameter per local expert (SequentialMLP), in the optimizer order ``order``."""

    def __init__(self, value: torch.Tensor, order: list[int]) -> None:
        self.order = order
        self.p = {e: torch.nn.Parameter(value[e].clone()) for e in order}
        self.opt = torch.optim.Adam([self.p[e] for e in order], lr=1e-2)
        self.shardings = [
            ShardedTensor.from_rank_offsets(KEY, self.p[e].data, (0, e, EXPERTS), prepend_axis_num=1) for e in order
        ]

    def steps(self, first: int, count: int, skip: dict[int, int] | None = None) -> None:
        for step in range(first, first + count):
            for e, p in self.p.items():
                # skip: expert -> a step at which it got no gradient (no tokens): Adam skips it.
                p.grad = None if (skip or {}).get(e) == step else grad(step)[e].clone()
            self.opt.step()

    def state(self, name: str) -> torch.Tensor:
        return torch.stack([self.opt.state[self.p[e]][name] for e in range(EXPERTS)])


def save(layout: Whole | Experts, directory: Path) -> None:
    sd = {"optimizer": sharded_optimizer_state(layout.opt, layout.shardings)}
    ckptd.save(sd, directory, fsync=False)


def resume(layout: Whole | Experts, directory: Path) -> None:
    template = optimizer_load_template(layout.opt, layout.shardings, directory)
    loaded = ckptd.load({"optimizer": template}, directory)["optimizer"]
    restore_optimizer_state(layout.opt, loaded, layout.shardings)


def reference_params(steps: int) -> torch.Tensor:
    whole = Whole(initial())
    whole.steps(0, steps)
    return whole.p.detach()


def test_one_param_resumes_as_local_experts_in_any_order(tmp_path, single_process):
    saved = Whole(initial())
    saved.steps(0, 2)
    save(saved, tmp_path / "c")
    for order in ([3, 2, 1, 0], [1, 3, 0, 2]):
        experts = Experts(reference_params(2), order)
        resume(experts, tmp_path / "c")
        for e in range(EXPERTS):
            st = experts.opt.state[experts.p[e]]
            assert float(st["step"]) == 2.0, (order, e)
            for n in MOMENTS:
                assert torch.equal(st[n], saved.state(n)[e]), f"order {order}: expert {e} has another's {n}"
        steps = [experts.opt.state[p]["step"] for p in experts.p.values()]
        assert len({id(s) for s in steps}) == EXPERTS  # each its own step tensor: no double count
        experts.steps(2, 2)
        resumed = torch.stack([experts.p[e].detach() for e in range(EXPERTS)])
        torch.testing.assert_close(resumed, reference_params(4), rtol=1e-6, atol=1e-7)
        assert all(float(s) == 4.0 for s in steps)


def test_local_experts_save_as_shards_of_their_key(tmp_path, single_process):
    saved = Experts(initial(), [2, 0, 3, 1])
    saved.steps(0, 3)
    save(saved, tmp_path / "c")
    meta = ckptd.load_tensors_metadata(tmp_path / "c")
    assert meta[f"optimizer.state.exp_avg.{KEY}"].global_shape == (EXPERTS, *SHAPE)
    assert meta[f"optimizer.state.step.{KEY}"].global_shape == ()
    stored = ckptd.load_plain_tensors(tmp_path / "c")
    for n in MOMENTS:
        assert torch.equal(stored[f"optimizer.state.{n}.{KEY}"], saved.state(n))

    whole = Whole(reference_params(3))
    resume(whole, tmp_path / "c")
    assert float(whole.state("step")) == 3.0
    for n in MOMENTS:
        assert torch.equal(whole.state(n), saved.state(n)), n

    experts = Experts(reference_params(3), [0, 1, 2, 3])
    resume(experts, tmp_path / "c")
    for n in MOMENTS:
        assert torch.equal(experts.state(n), saved.state(n)), n
    assert [float(experts.opt.state[experts.p[e]]["step"]) for e in range(EXPERTS)] == [3.0] * EXPERTS


def test_local_experts_with_different_steps_are_refused_at_save(tmp_path, single_process):
    experts = Experts(initial(), [0, 1, 2, 3])
    experts.steps(0, 2, skip={1: 1})  # expert 1 got no tokens at step 1: its step is 1, the others' 2
    with pytest.raises(ShardingError) as err:
        sharded_optimizer_state(experts.opt, experts.shardings)
    msg = str(err.value)
    assert "different optimizer 'step'" in msg and f"'{KEY}'" in msg and "rank 0" in msg
    assert "offset (0, 0, 0)" in msg and "offset (1, 0, 0)" in msg and "2.0 and 1.0" in msg
    assert "step every shard" in msg
    assert not (tmp_path / "c").exists()


def test_local_experts_missing_state_are_refused_at_save(single_process):
    experts = Experts(initial(), [0, 1, 2, 3])
    experts.steps(0, 1, skip={2: 0})  # expert 2 never had a gradient: no state at all
    with pytest.raises(
        ShardingError, match=r"different optimizer state: \['exp_avg', 'exp_avg_sq', 'step'\] and \[\]"
    ) as err:
        sharded_optimizer_state(experts.opt, experts.shardings)
    assert "offset (2, 0, 0)" in str(err.value) and f"'{KEY}'" in str(err.value)


def flat_params(value: torch.Tensor, cuts: list[int]) -> tuple[list[torch.nn.Parameter], list[ShardedTensor]]:
    """A distributed optimizer's flat ranges ``cuts[i]:cuts[i+1]`` of one tensor, all on this rank."""
    flat = value.reshape(-1)
    params = [torch.nn.Parameter(flat[a:b].clone()) for a, b in zip(cuts, cuts[1:])]
    shardings = [
        ShardedTensor.from_rank_offsets_flat(KEY, p.data, tuple(value.shape), flattened_range=slice(a, b))
        for p, a, b in zip(params, cuts, cuts[1:])
    ]
    return params, shardings


def test_flat_ranges_of_one_key_on_one_rank(tmp_path, single_process):
    value = initial()
    params, shardings = flat_params(value, [0, 5, 24])
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(2):
        for p, sh in zip(params, shardings):
            assert sh.flattened_range is not None
            p.grad = grad(step).reshape(-1)[sh.flattened_range].clone()
        opt.step()
    ckptd.save({"optimizer": sharded_optimizer_state(opt, shardings)}, tmp_path / "c", fsync=False)
    expected = {n: torch.cat([opt.state[p][n] for p in params]).reshape(value.shape) for n in MOMENTS}

    whole = Whole(value)
    resume(whole, tmp_path / "c")
    for n in MOMENTS:
        assert torch.equal(whole.state(n), expected[n]), n

    params2, shardings2 = flat_params(value, [0, 11, 13, 24])
    opt2 = torch.optim.Adam(params2, lr=1e-2)
    template = optimizer_load_template(opt2, shardings2, tmp_path / "c")
    restore_optimizer_state(opt2, ckptd.load({"o": template}, tmp_path / "c")["o"], shardings2)
    for n in MOMENTS:
        got = torch.cat([opt2.state[p][n] for p in params2]).reshape(value.shape)
        assert torch.equal(got, expected[n]), n
    assert [float(opt2.state[p]["step"]) for p in params2] == [2.0] * 3
