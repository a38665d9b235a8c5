"""A real Megatron-Core GPTModel (TP=2 and TP=1 on CPU, gloo) with its optimizer state, saved by
ckptd's Checkpointer, loaded at the other TP size by Megatron-Core's ``dist_checkpointing.load``
and by ``ckptd.load``, bit-exact against Megatron-Core's own save of the same state."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

import ckptd
from tests.megatron_rank import megatron_save_on_cpu
from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _save(rank: int, world: int, root: str, name: str) -> list[str]:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc

    from tests.real.megatron_gpt import adamw, build_gpt, sharded_state, train_a_little

    model = build_gpt(tp=world)
    opt = adamw(model)
    train_a_little(model, opt, seed=100 + rank)
    with ckptd.Checkpointer(os.path.join(root, f"{name}-ckptd")) as ckpt:
        handle = ckpt.save(sharded_state(model, opt, iteration=7), step=7)
        handle.wait(timeout_s=120)
    megatron_save_on_cpu()
    mcore_dir = os.path.join(root, f"{name}-mcore")
    if rank == 0:
        os.makedirs(mcore_dir)
    dist.barrier()
    mdc.save(sharded_state(model, opt, iteration=7), mcore_dir)
    dist.barrier()
    return []


def _load(rank: int, world: int, root: str, name: str) -> list[str]:
    from megatron.core import dist_checkpointing as mdc

    from tests.real.megatron_gpt import adamw, build_gpt, differences, flat, sharded_state

    model = build_gpt(tp=world)
    opt = adamw(model)

    def request() -> dict:
        """A request over zeroed parameters and optimizer state: every load must fill them (the
        loaders fill in place, so a load that read nothing would leave zeros)."""
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
                for t in opt.state[p].values():
                    t.zero_()
        return sharded_state(model, opt, 0)

    ckptd_dir = os.path.join(root, f"{name}-ckptd", "iter_0000007")
    reference = copy.deepcopy(mdc.load(request(), os.path.join(root, f"{name}-mcore")))
    bad = differences(reference, mdc.load(request(), ckptd_dir), "megatron load of ckptd")
    bad += differences(reference, ckptd.load(request(), os.path.join(root, f"{name}-mcore")), "ckptd load of megatron")
    bad += differences(reference, ckptd.load(request(), ckptd_dir), "ckptd load of ckptd")
    # ckptd.load filled the model's own parameters in place (Megatron-Core's semantics).
    loaded_params = {k: v for k, v in flat(reference).items() if k.startswith("model.")}
    live = {f"model.{k}": sh.data for k, sh in model.sharded_state_dict().items() if hasattr(sh, "data")}
    bad += differences(
        {k: live[k] for k in loaded_params if k in live},
        {k: v for k, v in loaded_params.items() if k in live},
        "parameters in place",
    )
    if len(flat(reference)) < 60 or reference["iteration"] != 7:
        bad.append(f"reference has {len(flat(reference))} entries, iteration {reference['iteration']}")
    if all(float(v.abs().sum()) == 0 for k, v in flat(reference).items() if isinstance(v, torch.Tensor)):
        bad.append("the reference is all zeros")
    return bad


def _load_then_save(rank: int, world: int, root: str, load_name: str, save_name: str) -> list[str]:
    """One process loads one TP size's checkpoints and saves its own (a process, its Megatron-Core
    import and its process group are most of a round's time)."""
    bad = _load(rank, world, root, load_name)
    _save(rank, world, root, save_name)
    return bad


@pytest.mark.timeout(450)
def test_gpt_tp2_to_tp1_and_tp1_to_tp2(tmp_path: Path, runtime_dir):
    env = {"CKPTD_RUNTIME_DIR": str(runtime_dir), "CKPTD_IDLE_EXIT_S": "2"}
    run_ranks(_save, 1, str(tmp_path), "tp1", timeout_s=120, daemon=False, env=env)
    # TP=2 loads the TP=1 checkpoints, then saves its own ...
    assert run_ranks(_load_then_save, 2, str(tmp_path), "tp1", "tp2", timeout_s=180, daemon=False, env=env) == [[], []]
    # ... which TP=1 loads.
    assert run_ranks(_load, 1, str(tmp_path), "tp2", timeout_s=120, daemon=False) == [[]]
    # The checkpoint holds every tensor of the model and its optimizer, not pickled objects.
    tensors = ckptd.load_tensors_metadata(tmp_path / "tp2-ckptd" / "iter_0000007")
    model_keys = [k for k in tensors if not k.startswith("optimizer.")]
    assert len(model_keys) >= 15
    assert all(f"optimizer.state.{m}.{k}" in tensors for k in model_keys for m in ("exp_avg", "exp_avg_sq"))
    assert ckptd.load_common_state_dict(tmp_path / "tp2-ckptd" / "iter_0000007")["iteration"] == 7
