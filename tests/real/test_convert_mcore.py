"""A real Megatron-Core GPTModel's legacy checkpoint (``torch.save`` of its ``state_dict()`` per TP
rank, as Megatron-LM's ``--ckpt-format torch`` writes it) converted by ``ckptd convert to-dist
--mcore-spec`` and loaded as-is by Megatron-Core's ``dist_checkpointing.load`` and by
``ckptd.load`` into a fresh GPTModel, bit-exact against Megatron-Core's own torch_dist save of the
same model."""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.convert import convert_legacy
from tests.megatron_rank import megatron_save_on_cpu
from tools.harness.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
ROOT = Path(__file__).resolve().parents[2]
# What GPTModel.sharded_state_dict asks for when its layers are not stacked.
PER_LAYER = {"non_homogeneous_layers": True}


def _write(rank: int, world: int, root: str) -> list[str]:
    """Perturb a TP=``world`` GPT (replicated parameters alike on every TP rank), write its legacy
    rank file, and save it with Megatron-Core's torch_dist as the reference."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as mdc

    from tests.real.megatron_gpt import build_gpt

    model = build_gpt(tp=world)
    with torch.no_grad():
        for name, p in model.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (1000 * rank if split else 0))
            p.add_(torch.randn(p.shape, generator=gen))
    rank_dir = Path(root, "legacy", "iter_0000005", f"mp_rank_{rank:02d}")
    rank_dir.mkdir(parents=True)
    args = argparse.Namespace(num_layers=2, tensor_model_parallel_size=world, pipeline_model_parallel_size=1)
    torch.save(
        {"model": model.state_dict(), "args": args, "iteration": 5, "checkpoint_version": 3.0},
        rank_dir / "model_optim_rng.pt",
    )
    megatron_save_on_cpu()
    mcore_dir = os.path.join(root, "mcore")
    if rank == 0:
        Path(root, "legacy", "latest_checkpointed_iteration.txt").write_text("5")
        os.makedirs(mcore_dir)
    dist.barrier()
    mdc.save(model.sharded_state_dict(), mcore_dir)
    dist.barrier()
    return []


def _load(rank: int, world: int, root: str) -> list[str]:
    from megatron.core import dist_checkpointing as mdc

    from tests.real.megatron_gpt import build_gpt, differences, flat

    model = build_gpt(tp=world)

    def request(metadata: dict | None = None) -> dict:
        """Over zeroed parameters: a load that read nothing would leave zeros."""
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        return model.sharded_state_dict(metadata=metadata)

    reference = copy.deepcopy(mdc.load(request(), os.path.join(root, "mcore")))

    def model_part(loaded: dict) -> dict:
        """The model entries (the loaders add the converted checkpoint's common state: args...)."""
        return {k: v for k, v in loaded.items() if k in reference}

    stacked, per_layer = os.path.join(root, "stacked"), os.path.join(root, "per-layer")
    bad = differences(reference, model_part(mdc.load(request(), stacked)), "megatron load of --stack-layers")
    bad += differences(reference, model_part(ckptd.load(request(), stacked)), "ckptd load of --stack-layers")
    bad += differences(reference, model_part(mdc.load(request(PER_LAYER), per_layer)), "megatron load of per-layer")
    bad += differences(reference, model_part(ckptd.load(request(PER_LAYER), per_layer)), "ckptd load of per-layer")
    values = flat(reference)
    extra = [k for k in values if k.endswith("_extra_state")]
    if len(extra) != 8 or any(values[k] is not None for k in extra):
        bad.append(f"reference extra states: {extra}")
    tensors = [v for v in values.values() if isinstance(v, torch.Tensor)]
    if len(tensors) < 20 or any(float(t.abs().sum()) == 0 for t in tensors):
        bad.append(f"the reference has {len(tensors)} tensors, or one is all zeros")
    return bad


@pytest.mark.timeout(600)
def test_converted_legacy_gpt_loads_as_is_into_megatron_core(tmp_path: Path):
    env = {"PYTHONPATH": str(ROOT)}
    assert run_ranks(_write, 2, str(tmp_path), timeout_s=180, daemon=False) == [[], []]
    legacy = tmp_path / "legacy"
    # The command line, stacked and spec detected from the keys (the local spec's input_layernorm).
    out = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "convert", "to-dist", str(legacy), str(tmp_path / "stacked")]
        + ["--stack-layers", "--mcore-spec", "auto", "--no-fsync"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "and 8 objects" in out.stdout and "skipped non-tensor entries: ['output_layer._extra_state']" in out.stdout
    report = convert_legacy(legacy, tmp_path / "per-layer", mcore_spec="local", fsync=False)
    assert report.objects == 8 and report.skipped == ["output_layer._extra_state"]
    # The TP=2 legacy files load at TP=1 and at TP=2.
    assert run_ranks(_load, 1, str(tmp_path), timeout_s=180, daemon=False) == [[]]
    assert run_ranks(_load, 2, str(tmp_path), timeout_s=180, daemon=False) == [[], []]
