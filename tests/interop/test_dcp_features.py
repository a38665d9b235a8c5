"""Checkpoints written by torch DCP with a stream transform (ZStandard): ckptd reports them as
unsupported, never as damaged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import UnsupportedFormatError
from ckptd.recovery import structural_problem
from ckptd.verify import verify_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]


def trained_state() -> dict:
    """A small model after one AdamW step, as ``get_state_dict`` returns it, plus an iteration."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 6)).square().mean().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "iteration": 1234}


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "ckptd.commands", *argv], env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_stream_transform_is_unsupported_not_damaged(tmp_path):
    state = trained_state()
    writer = dcp.FileSystemWriter(str(tmp_path / "z"), _extensions=[ZStandard()])
    dcp.save(state, storage_writer=writer, no_dist=True)
    w = state["model"]["0.weight"]
    # torch DCP itself reads it back (the checkpoint is sound).
    out = {"model": {"0.weight": torch.zeros_like(w)}}
    dcp.load(out, checkpoint_id=str(tmp_path / "z"), no_dist=True)
    assert torch.equal(out["model"]["0.weight"], w)

    expected = r"tensor 'model\.0\.weight' is stored with the stream transform\(s\) \['stream\.zstd/1'\]"
    with pytest.raises(UnsupportedFormatError, match=expected + r".*torch\.distributed\.checkpoint\.load"):
        ckptd.load({"model.0.weight": ShardedTensor.from_rank_offsets("model.0.weight", torch.zeros_like(w))},
                   tmp_path / "z")
    with pytest.raises(UnsupportedFormatError, match=expected):
        ckptd.load_tensors_metadata(tmp_path / "z")

    for deep in (False, True):
        report = verify_checkpoint(tmp_path / "z", deep=deep)
        assert (report.status, report.ok, report.errors) == ("UNSUPPORTED", False, [])
        [finding] = report.unsupported
        assert finding.check == "metadata" and "stream.zstd/1" in finding.message
    assert "stream.zstd/1" in structural_problem(tmp_path / "z")  # never chosen to resume from

    run = _cli("verify", "--deep", "--json", str(tmp_path / "z"))
    assert run.returncode == 3 and json.loads(run.stdout)["status"] == "UNSUPPORTED", run.stdout + run.stderr
    run = _cli("verify", str(tmp_path / "z"))
    assert run.returncode == 3 and ": UNSUPPORTED" in run.stdout and "DAMAGED" not in run.stdout
    run = _cli("inspect", str(tmp_path / "z"))
    assert run.returncode == 1 and "model.0.weight" in run.stderr and "stream.zstd/1" in run.stderr
