"""Checkpoints real Megatron-Core 0.13 and 0.15 wrote, kept as files (tests/interop/megatron_core_files):
their ``.metadata`` holds Megatron-Core's own subclasses of DCP's classes (every rank's plan an
``MCoreSavePlan``; in 0.15 the whole object an ``MCoreMetadata``), which ckptd reads as the DCP
classes they extend. It refused them, and a resume took such a checkpoint for damaged.

How the files were made, once (the installed Megatron-Core is 0.16, which writes neither class):
``git archive core_v0.13.0`` and ``core_v0.15.0`` of github.com/NVIDIA/Megatron-LM, its ``megatron/``
first on ``sys.path`` of two gloo ranks on CPU (torch 2.13, ``torch.cuda.synchronize`` and
``current_device`` replaced as tests/megatron_rank.py does), each rank calling
``megatron.core.dist_checkpointing.save`` of
``{"w": ShardedTensor.from_rank_offsets("w", W.chunk(2, 0)[rank], (0, rank, 2)),
"b": ShardedTensor.from_rank_offsets("b", B.chunk(2, 0)[rank], (0, rank, 2)),
"rng": ShardedObject("rng", {"seed": rank}, (2,), (rank,)), "iteration": 3}`` with :data:`W`
and :data:`B` below.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.recovery import resolve_latest
from ckptd.verify import verify_checkpoint
from tests.cli import offline_cli

FILES = Path(__file__).parent / "megatron_core_files"
W = torch.arange(24, dtype=torch.float32).reshape(4, 6) + 0.5
B = torch.arange(6, dtype=torch.bfloat16) - 2
# The Megatron-Core classes each version's .metadata names.
CLASSES = {"v0_13": [b"MCoreSavePlan"], "v0_15": [b"MCoreSavePlan", b"MCoreMetadata"]}


def _request() -> dict:
    return {
        "w": ckptd.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6)),
        "b": ckptd.ShardedTensor.from_rank_offsets("b", torch.zeros(6, dtype=torch.bfloat16)),
        "rng": [ckptd.ShardedObject("rng", None, (2,), (r,)) for r in range(2)],
    }


@pytest.mark.parametrize("version", sorted(CLASSES))
def test_a_checkpoint_megatron_core_wrote_with_its_own_metadata_classes_loads_bit_exact(tmp_path, version):
    root = tmp_path / "root"
    ckpt = root / step_dir_name(3)
    shutil.copytree(FILES / version, ckpt)
    raw = (ckpt / ".metadata").read_bytes()
    assert b"megatron.core.dist_checkpointing.strategies.torch" in raw
    assert all(name in raw for name in CLASSES[version])
    for allow_unsafe_pickle in (False, True):  # unsafe: Megatron-Core 0.16's classes of those names are empty
        out = ckptd.load(_request(), ckpt, allow_unsafe_pickle=allow_unsafe_pickle)
        assert torch.equal(out["w"], W) and torch.equal(out["b"], B), out
        assert out["w"].dtype == torch.float32 and out["b"].dtype == torch.bfloat16
        assert out["rng"] == [{"seed": 0}, {"seed": 1}] and out["iteration"] == 3
    assert torch.equal(ckptd.load_plain_tensors(ckpt)["w"], W)
    report = verify_checkpoint(ckpt, deep=True)
    assert report.status == "OK" and report.items_decoded == 6, report.findings
    run = offline_cli("verify", "--deep", str(ckpt))
    assert run.returncode == 0 and f"{ckpt}: OK" in run.stdout, run.stdout + run.stderr
    # A resume takes it (the tracker names it), not a step before it.
    (root / TRACKER_FILE).write_bytes(tracker_bytes(ckpt.name))
    choice = resolve_latest(root)
    assert choice is not None and choice.step == 3 and choice.fallback_reason is None
