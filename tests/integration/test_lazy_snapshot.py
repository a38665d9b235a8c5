"""Lazy snapshots (snapshot="lazy"): save() returns before the copy; the copy runs behind
training; before_update() (or attach(optimizer)) fences it. Never torn: a tensor changed before
its copy was complete fails the save instead. Real daemon, real files, one process."""

from __future__ import annotations

import tempfile

import pytest
import torch

import ckptd
from ckptd import SaveFailedError, ShardedTensor
from tests.interop.reference import same_bits


def _config(**kw) -> ckptd.CkptdConfig:
    runtime = tempfile.mkdtemp(prefix="ckl", dir="/tmp")
    return ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=2.0, heartbeat_s=0.2, snapshot="lazy", **kw)


def _state(tensors: dict[str, torch.Tensor], step: int) -> dict:
    return {**{k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}, "step": step}


def _load(ckpt: ckptd.Checkpointer, like: dict[str, torch.Tensor], step: int) -> dict:
    return ckpt.load(_state({k: torch.zeros_like(v) for k, v in like.items()}, -1), step=step)


@pytest.mark.timeout(180)
def test_lazy_saves_with_an_attached_optimizer_commit_exact_values(tmp_path, single_process):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected = {}
    with ckptd.Checkpointer(tmp_path / "run", config=_config()) as ckpt:
        ckpt.attach(opt)
        handles = []
        for step in range(1, 7):
            loss = model(torch.randn(8, 256)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # the pre-hook fences the previous lazy save before the update
            params = {f"p{i}": p.data for i, p in enumerate(model.parameters())}
            handles.append(ckpt.save(_state(params, step), step=step))
            expected[step] = {k: v.clone() for k, v in params.items()}
            model(torch.randn(8, 256)).sum()  # forward while the copy runs: reads only
        for h in handles:
            h.wait(timeout_s=60)
        for step in (1, 4, 6):
            out = _load(ckpt, expected[step], step)
            assert all(same_bits(out[k], expected[step][k]) for k in expected[step]), step


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fenced", [False, True])
def test_a_tensor_changed_before_the_fence_fails_the_save_never_tears_it(tmp_path, single_process, fenced):
    """Each save changes one of its tensors (an optimizer step on it) at one point: right after
    save() returned (the copy is running) or once the copy is complete; before the fence
    (before_update()) or after it. Changed before the fence: the save fails, whatever the copy had
    done; after: it commits exactly the saved values. Never a mix."""
    names = [f"t{i}" for i in range(4)]
    with ckptd.Checkpointer(tmp_path / "run", config=_config()) as ckpt:
        step = 0
        for victim in names:
            for when in ("during the copy", "after the copy"):
                step += 1
                tensors = {k: torch.full((1 << 20,), float(step * 10 + i)) for i, k in enumerate(names)}
                saved = {k: v.clone() for k, v in tensors.items()}
                handle = ckpt.save(_state(tensors, step), step=step)
                if when == "after the copy":
                    assert ckpt._lazy._pending[-1].copied.wait(30)  # the copier is done, not fenced yet
                if fenced:
                    ckpt.before_update()
                tensors[victim].add_(1000.0)
                if not fenced:
                    ckpt.before_update()
                if fenced:
                    handle.wait(timeout_s=60)
                    out = _load(ckpt, saved, step)
                    assert all(same_bits(out[k], saved[k]) for k in names), (step, victim, when)
                else:
                    with pytest.raises(SaveFailedError, match="abandoned its snapshot"):
                        handle.wait(timeout_s=60)
                    assert ckpt.latest() != step


@pytest.mark.timeout(120)
def test_lazy_save_of_non_contiguous_tensors_and_objects(tmp_path, single_process):
    w = torch.randn(64, 32)
    with ckptd.Checkpointer(tmp_path / "run", config=_config()) as ckpt:
        sd = {
            "wt": ShardedTensor.from_rank_offsets("wt", w.t()),
            "obj": ckptd.ShardedObject("obj", {"a": 1}, (1,), (0,)),
            "step": 1,
        }
        h = ckpt.save(sd, step=1)
        ckpt.before_update()
        w.mul_(2)  # after the fence: the save keeps the values it was given
        h.wait(timeout_s=60)
        out = ckpt.load(
            {
                "wt": ShardedTensor.from_rank_offsets("wt", torch.empty(32, 64)),
                "obj": ckptd.ShardedObject("obj", None, (1,), (0,)),
            }
        )
        assert same_bits(out["wt"], (w / 2).t().contiguous()) and out["obj"] == {"a": 1} and out["step"] == 1
