"""The README's example runs as printed: the first run saves, the second resumes from it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.multiproc import without_torchrun

REPO = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Example"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(180)
def test_readme_example_saves_then_resumes(tmp_path):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 22
    runtime = tempfile.mkdtemp(prefix="ckr", dir="/tmp")
    env = {**without_torchrun(os.environ), "CKPTD_RUNTIME_DIR": runtime, "CKPTD_IDLE_EXIT_S": "1"}
    outs = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(run.stdout)
    assert "latest committed step: 15" in outs[0]
    assert "latest committed step: 35" in outs[1]  # resumed at 16, saved 20..35
    assert sorted(p.name for p in (tmp_path / "ckpts" / "run1").glob("iter_*")) == [
        f"iter_{s:07d}" for s in (0, 5, 10, 15, 20, 25, 30, 35)]
    subprocess.run([sys.executable, "-m", "ckptd.cli", "daemon", "stop", "--root", str(tmp_path / "ckpts" / "run1")],
                   env=env, timeout=60, check=True, capture_output=True)
    shutil.rmtree(runtime)


def readme_blocks(heading: str) -> list[str]:
    """The python code blocks of the README section under ``heading`` (up to the next heading)."""
    text = (REPO / "README.md").read_text()
    start = text.index(heading)
    end = text.find("\n##", start + len(heading))
    return re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], re.S)


def _fsdp2_blocks_resume_exactly(rank: int, world: int, root: str) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptd

    (code,) = readme_blocks("### Using it from FSDP2 / DCP code")

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def trainer(model, optimizer):
        def train_step(step):
            gen = torch.Generator().manual_seed(step * 10 + rank)
            loss = model(torch.randn(4, 6, generator=gen)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return train_step

    model, optimizer = build()  # the uninterrupted reference: steps 1..4
    for step in range(1, 5):
        trainer(model, optimizer)(step)
    reference = [p.full_tensor().clone() for p in model.parameters()]
    for _ in range(2):  # the README's lines, twice: steps 1-2 and save; then resume, steps 3-4
        model, optimizer = build()
        scope = {"ckptd": ckptd, "model": model, "optimizer": optimizer, "ckpt_root": root,
                 "train_step": trainer(model, optimizer)}
        exec(code, scope)
        scope["ckpt"].close()
        dist.barrier()
    params = [p.full_tensor() for p in model.parameters()]
    return [] if all(torch.equal(a, b) for a, b in zip(params, reference)) else ["not bit-exact"]


@pytest.mark.timeout(240)
def test_readme_fsdp2_lines_resume_bit_exact(tmp_path):
    from tests.multiproc import run_ranks

    env = {"CKPTD_RUNTIME_DIR": tempfile.mkdtemp(prefix="ckr", dir="/tmp"), "CKPTD_IDLE_EXIT_S": "1"}
    assert run_ranks(_fsdp2_blocks_resume_exactly, 2, str(tmp_path / "run"), timeout_s=200, env=env) == [[], []]
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == [f"iter_{s:07d}" for s in (1, 2, 3, 4)]


def _megatron_blocks_round_trip(rank: int, world: int, root: str) -> list[str]:
    import torch

    import ckptd
    from tests.real.megatron_gpt import adamw, build_gpt, sharded_state, train_a_little

    save_code, load_code = readme_blocks("### Using it from Megatron-Core / Megatron-LM")
    model = build_gpt(tp=world)
    optimizer = adamw(model)
    train_a_little(model, optimizer, seed=0)  # replicated parameters stay equal across TP ranks, as in training
    saved = [p.detach().clone() for p in model.parameters()]
    scope = {"ckptd": ckptd, "save_dir": root, "iteration": 12,
             "state_dict": sharded_state(model, optimizer, iteration=12)}
    exec(save_code, scope)
    scope["handle"].wait(timeout_s=120)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    scope["state_dict"] = sharded_state(model, optimizer, iteration=0)
    exec(load_code, scope)
    scope["ckpt"].close()
    ok = scope["iteration"] == 12 and all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))
    return [] if ok else [f"iteration {scope['iteration']}, parameters restored: {ok}"]


@pytest.mark.timeout(240)
def test_readme_megatron_lines_save_and_load(tmp_path):
    from tests.multiproc import run_ranks

    env = {"CKPTD_RUNTIME_DIR": tempfile.mkdtemp(prefix="ckr", dir="/tmp"), "CKPTD_IDLE_EXIT_S": "1"}
    assert run_ranks(_megatron_blocks_round_trip, 2, str(tmp_path / "run"), timeout_s=200, daemon=False,
                     env=env) == [[], []]
