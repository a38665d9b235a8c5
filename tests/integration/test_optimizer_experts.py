"""Adam over Megatron-style local experts resumes at other expert layouts (2 real gloo ranks).

The experts of a layer share one checkpoint key on a prepended expert axis (Megatron-Core's
SequentialMLP), so a rank holds several optimizer parameters of one key at different offsets.
Layouts: ``ep2`` (rank r holds experts 2r+1 and 2r, in that optimizer order), ``ep2strided``
(rank r holds r and r+2), ``ep1`` (one process, every expert in a shuffled order) and ``whole``
(one process, one parameter holding every expert). ``ep2`` saved at 2 ranks resumes as
``ep2strided`` (2 ranks), ``whole`` and ``ep1``; ``whole`` resumes as ``ep2strided``. Each
expert's exp_avg, exp_avg_sq and step must be its own, bit for bit, and two further steps must
track an uninterrupted run. Shards of one key with different steps are refused on the rank
holding them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import ShardingError
from ckptd.optim import optimizer_load_template, restore_optimizer_state, sharded_optimizer_state
from tools.harness.ranks import run_ranks

KEY = "decoder.layers.mlp.experts.linear_fc1.weight"
NORM = "decoder.final_layernorm.weight"
EXPERTS, SHAPE = 4, (3, 2)
LR = 1e-2
MOMENTS = ("exp_avg", "exp_avg_sq")
HOLDS = {
    "ep2": lambda r: [2 * r + 1, 2 * r],
    "ep2strided": lambda r: [r, r + 2],
    "ep1": lambda r: [3, 1, 0, 2],
    "whole": lambda r: [],
}


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {KEY: torch.randn((EXPERTS, *SHAPE), generator=g), NORM: torch.randn(4, generator=g)}


def grad(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {KEY: torch.randn((EXPERTS, *SHAPE), generator=g), NORM: torch.randn(4, generator=g)}


class Rank:
    """One rank of a layout: its parameters (name -> expert index or None), shardings and Adam."""

    def __init__(self, layout: str, rank: int, values: dict[str, torch.Tensor]) -> None:
        self.params: list[tuple[str, int | None, torch.nn.Parameter]] = []
        self.shardings: list[ShardedTensor] = []
        experts = HOLDS[layout](rank)
        if not experts:
            p = torch.nn.Parameter(values[KEY].clone())
            self.params.append((KEY, None, p))
            self.shardings.append(ShardedTensor.from_rank_offsets(KEY, p.data))
        for e in experts:
            p = torch.nn.Parameter(values[KEY][e].clone())
            self.params.append((KEY, e, p))
            self.shardings.append(ShardedTensor.from_rank_offsets(KEY, p.data, (0, e, EXPERTS), prepend_axis_num=1))
        norm = torch.nn.Parameter(values[NORM].clone())
        self.params.append((NORM, None, norm))
        self.shardings.append(ShardedTensor.from_rank_offsets(NORM, norm.data, replica_id=rank))
        self.opt = torch.optim.Adam([p for _, _, p in self.params], lr=LR)

    def steps(self, first: int, count: int) -> None:
        for step in range(first, first + count):
            g = grad(step)
            for key, e, p in self.params:
                p.grad = (g[key] if e is None else g[key][e]).clone()
            self.opt.step()

    def model_sd(self) -> dict[str, ShardedTensor]:
        return {f"{sh.key}.{i}": sh for i, sh in enumerate(self.shardings)}


def saved_state(layout: str, world: int, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every saving rank of ``layout`` simulated here; their state written into full tensors."""
    full = {k: {n: torch.full(v.shape, float("nan")) for n in MOMENTS} for k, v in initial().items()}
    for r in range(world):
        rk = Rank(layout, r, initial())
        rk.steps(0, steps)
        for key, e, p in rk.params:
            for n in MOMENTS:
                (full[key][n] if e is None else full[key][n][e]).copy_(rk.opt.state[p][n])
    return full


def reference(steps: int) -> dict[str, torch.Tensor]:
    rk = Rank("whole", 0, initial())
    rk.steps(0, steps)
    return {key: p.detach() for key, _, p in rk.params}


def resume(layout: str, rank: int, directory: Path, expected: dict[str, dict[str, torch.Tensor]]) -> None:
    rk = Rank(layout, rank, reference(3))
    template = optimizer_load_template(rk.opt, rk.shardings, directory)
    loaded = ckptd.load({"model": rk.model_sd(), "optimizer": template}, directory)["optimizer"]
    restore_optimizer_state(rk.opt, loaded, rk.shardings)
    for key, e, p in rk.params:
        st = rk.opt.state[p]
        assert float(st["step"]) == 3.0, (layout, key, e)
        for n in MOMENTS:
            want = expected[key][n] if e is None else expected[key][n][e]
            assert torch.equal(st[n], want), f"{layout} rank {rank}: {key} expert {e} got another's {n}"
    rk.steps(3, 2)
    ref5 = reference(5)
    for key, e, p in rk.params:
        torch.testing.assert_close(p.detach(), ref5[key] if e is None else ref5[key][e], rtol=1e-6, atol=1e-7)


def _save(rank: int, world: int, root: str) -> None:
    rk = Rank("ep2", rank, initial())
    rk.steps(0, 3)
    sd = {"model": rk.model_sd(), "optimizer": sharded_optimizer_state(rk.opt, rk.shardings)}
    ckptd.save(sd, Path(root) / "ep2", fsync=False)


def _resume(rank: int, world: int, root: str) -> list[str]:
    for saved, world_saved in (("ep2", 2), ("whole", 1)):
        resume("ep2strided", rank, Path(root) / saved, saved_state(saved, world_saved, 3))
    return ["ep2->ep2strided", "whole->ep2strided"]


def _differing_steps(rank: int, world: int) -> str:
    rk = Rank("ep2", rank, initial())
    rk.steps(0, 2)
    if rank == 1:  # expert 2 (offset 2) got no tokens at the last step: Adam skipped it
        rk.params[1][2].grad = None
        rk.params[0][2].grad = grad(2)[KEY][3].clone()
        rk.opt.step()
    try:
        sharded_optimizer_state(rk.opt, rk.shardings)
    except ShardingError as e:
        return str(e)
    return ""


@pytest.mark.timeout(240)
def test_local_experts_resume_at_other_expert_layouts(tmp_path, single_process):
    run_ranks(_save, 2, str(tmp_path), timeout_s=100)
    meta = ckptd.load_tensors_metadata(tmp_path / "ep2")
    assert meta[f"optimizer.state.exp_avg.{KEY}"].global_shape == (EXPERTS, *SHAPE)
    assert meta[f"optimizer.state.step.{KEY}"].global_shape == ()

    whole = Rank("whole", 0, initial())
    whole.steps(0, 3)
    sd = {"model": whole.model_sd(), "optimizer": sharded_optimizer_state(whole.opt, whole.shardings)}
    ckptd.save(sd, tmp_path / "whole", fsync=False)

    expected = saved_state("ep2", 2, 3)
    for layout in ("whole", "ep1"):
        resume(layout, 0, tmp_path / "ep2", expected)
    results = run_ranks(_resume, 2, str(tmp_path), timeout_s=100)
    assert results == [["ep2->ep2strided", "whole->ep2strided"]] * 2


@pytest.mark.timeout(120)
def test_local_experts_with_different_steps_name_the_rank(single_process):
    messages = run_ranks(_differing_steps, 2, timeout_s=100)
    assert messages[0] == ""
    msg = messages[1]
    assert "rank 1" in msg and f"'{KEY}'" in msg and "different optimizer 'step'" in msg
    assert "offset (3, 0, 0)" in msg and "offset (2, 0, 0)" in msg and "3.0 and 2.0" in msg
