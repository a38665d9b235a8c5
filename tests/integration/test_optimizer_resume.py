"""An Adam optimizer saved at one layout resumes at another (2 real gloo ranks).

Layouts: ``tp2`` (each rank optimizes its N-D tensor-parallel shards), ``dp2flat`` (a
distributed optimizer: each rank optimizes flat fp32 slices of the parameters) and ``full`` (one
rank, whole tensors). A tied parameter (``head.weight`` is ``embed.weight``) must be stored once.
Each saved optimizer is reloaded at the other layouts; its state must equal, bit for bit, the
saved state (assembled from every saving rank), and two further steps must track an
uninterrupted full-tensor run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.optim import optimizer_load_template, param_shardings, restore_optimizer_state, sharded_optimizer_state
from tests.integration.layouts import split
from tools.harness.ranks import run_ranks

SHAPES = {
    "embed.weight": ((10, 4), 0),
    "fc.weight": ((6, 4), 0),
    "proj.weight": ((4, 6), 1),
    "norm.weight": ((4,), None),
}
KEYS = list(SHAPES)
LR = 1e-2


def initial(key: str) -> torch.Tensor:
    return torch.randn(SHAPES[key][0], generator=torch.Generator().manual_seed(len(key) * 31 + ord(key[0])))


def grad(step: int, key: str) -> torch.Tensor:
    return torch.randn(
        SHAPES[key][0], generator=torch.Generator().manual_seed(step * 1000 + ord(key[0]) * 7 + len(key))
    )


class Rank:
    """One rank of a layout: its parameters, their shardings and an Adam over them."""

    def __init__(self, layout: str, rank: int, values: dict[str, torch.Tensor]) -> None:
        self.layout, self.rank = layout, rank
        self.params: dict[str, torch.Tensor] = {}
        self.shardings: list[ShardedTensor] = []
        self.model_sd: dict[str, ShardedTensor] = {}
        if layout == "dp2flat":
            numels = [values[k].numel() for k in KEYS]
            lo, n = split(sum(numels), 2, rank)
            base = 0
            for k, numel in zip(KEYS, numels):
                a, b = max(lo, base) - base, min(lo + n, base + numel) - base
                base += numel
                self.model_sd[k] = ShardedTensor.from_rank_offsets(k, values[k].clone(), replica_id=rank)
                if a >= b:
                    continue
                p = torch.nn.Parameter(values[k].reshape(-1)[a:b].clone())
                self.params[k] = p
                self.shardings.append(
                    ShardedTensor.from_rank_offsets_flat(k, p.data, SHAPES[k][0], flattened_range=slice(a, b))
                )
        else:
            tp = 2 if layout == "tp2" else 1
            for k in KEYS:
                axis = SHAPES[k][1]
                if axis is None or tp == 1:
                    p = torch.nn.Parameter(values[k].clone())
                    sh = ShardedTensor.from_rank_offsets(k, p.data, replica_id=rank if axis is None else 0)
                else:
                    p = torch.nn.Parameter(values[k].chunk(tp, axis)[rank].clone())
                    sh = ShardedTensor.from_rank_offsets(k, p.data, (axis, rank, tp))
                self.params[k] = p
                self.model_sd[k] = sh
            # The tied head wraps the very same parameter: the optimizer must not duplicate it.
            self.model_sd["head.weight"] = ShardedTensor.from_rank_offsets(
                "head.weight", self.params["embed.weight"].data, *([(0, rank, tp)] if tp > 1 else [])
            )
        self.opt = torch.optim.Adam(list(self.params.values()), lr=LR)
        if layout != "dp2flat":
            self.shardings = param_shardings(self.opt, self.model_sd)

    def local(self, key: str, full: torch.Tensor) -> torch.Tensor:
        sh = next(s for s in self.shardings if s.key == key)
        box = full[tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.chunk_shape()))]
        if sh.flattened_range is not None:
            return box.reshape(-1)[sh.flattened_range]
        return box.reshape(sh.local_shape)

    def steps(self, first: int, count: int) -> None:
        for step in range(first, first + count):
            for k, p in self.params.items():
                p.grad = self.local(k, grad(step, k)).clone()
            self.opt.step()


def assembled_state(layout: str, world: int, steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every saving rank of ``layout`` simulated here; their state written into full tensors."""
    full = {k: {n: torch.full(SHAPES[k][0], float("nan")) for n in ("exp_avg", "exp_avg_sq")} for k in KEYS}
    for r in range(world):
        rk = Rank(layout, r, {k: initial(k) for k in KEYS})
        rk.steps(0, steps)
        for sh, p in zip(rk.shardings, rk.opt.param_groups[0]["params"]):
            for n in ("exp_avg", "exp_avg_sq"):
                box = full[sh.key][n][tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.chunk_shape()))]
                if sh.flattened_range is not None:
                    view = box.reshape(-1)  # a view: box is contiguous for these row-blocks
                    assert view.data_ptr() == box.data_ptr()
                    view[sh.flattened_range] = rk.opt.state[p][n]
                else:
                    box.copy_(rk.opt.state[p][n].reshape(box.shape))
    return full


def reference_params(steps: int) -> dict[str, torch.Tensor]:
    params = {k: torch.nn.Parameter(initial(k)) for k in KEYS}
    opt = torch.optim.Adam(list(params.values()), lr=LR)
    for step in range(steps):
        for k, p in params.items():
            p.grad = grad(step, k)
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def _save(rank: int, world: int, root: str) -> None:
    for layout in ("tp2", "dp2flat"):
        rk = Rank(layout, rank, {k: initial(k) for k in KEYS})
        rk.steps(0, 3)
        sd = {"model": rk.model_sd, "optimizer": sharded_optimizer_state(rk.opt, rk.shardings)}
        ckptd.save(sd, Path(root) / layout, fsync=False)


def _resume(rank: int, world: int, root: str) -> list[str]:
    done = []
    for saved, targets in (("tp2", ("dp2flat", "full")), ("dp2flat", ("tp2", "full"))):
        directory = Path(root) / saved
        expected = assembled_state(saved, 2, 3)
        values = {k: v.detach() for k, v in reference_params(3).items()}
        for target in targets:
            if target == "full" and rank != 0:
                continue
            # Model weights come from the checkpoint too (here: the reference values at step 3).
            rk = Rank(target, rank, values)
            template = optimizer_load_template(rk.opt, rk.shardings, directory)
            loaded = ckptd.load({"optimizer": template}, directory)["optimizer"]
            restore_optimizer_state(rk.opt, loaded, rk.shardings)
            for sh, p in zip(rk.shardings, rk.opt.param_groups[0]["params"]):
                st = rk.opt.state[p]
                assert float(st["step"]) == 3.0 and rk.opt.param_groups[0]["lr"] == LR
                for n in ("exp_avg", "exp_avg_sq"):
                    want = rk.local(sh.key, expected[sh.key][n])
                    assert torch.equal(st[n], want), f"{saved}->{target} {sh.key} {n}"
            rk.steps(3, 2)
            ref5 = reference_params(5)
            for k, p in rk.params.items():
                torch.testing.assert_close(p.detach(), rk.local(k, ref5[k]), rtol=1e-6, atol=1e-7)
            done.append(f"{saved}->{target}")
    return done


@pytest.mark.timeout(240)
def test_optimizer_resumes_at_other_layouts(tmp_path):
    run_ranks(_save, 2, str(tmp_path), timeout_s=100)
    keys = ckptd.load_tensors_metadata(tmp_path / "tp2")
    assert "optimizer.state.exp_avg.embed.weight" in keys
    assert not any(k.startswith("optimizer.") and "head" in k for k in keys)  # tied: stored once
    assert keys["optimizer.state.step.fc.weight"].global_shape == ()
    assert keys["optimizer.state.exp_avg.proj.weight"].global_shape == (4, 6)
    # Group hyper-parameters are stored per key (a ShardedObject each), not as rank 0's list.
    groups = {k: o for k, o in ckptd.load_sharded_metadata(tmp_path / "dp2flat").items() if ".group." in k}
    assert "optimizer.group.fc.weight/shard_0_1" in groups and "param_groups" not in str(
        ckptd.load_common_state_dict(tmp_path / "dp2flat")
    )
    results = run_ranks(_resume, 2, str(tmp_path), timeout_s=100)
    assert sorted(results[0]) == ["dp2flat->full", "dp2flat->tp2", "tp2->dp2flat", "tp2->full"]
    assert sorted(results[1]) == ["dp2flat->tp2", "tp2->dp2flat"]
