"""Plain torch DCP checkpoints as real training code writes them: a model with its AdamW state from
``get_state_dict`` plus an iteration count (``ckptd verify --deep`` must call them sound, and
still find damage), and checkpoints written with a DCP stream transform (ZStandard), which ckptd
reports as unsupported, never as damaged.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import UnsupportedFormatError
from ckptd.format.dcp_metadata import read_index, records_from_index
from ckptd.recovery import structural_problem
from ckptd.verify import ERROR, verify_checkpoint
from tests.checkpoints import flip_bit
from tests.cli import offline_cli

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
    return offline_cli(*argv)


def _record(directory: Path, fqn: str):
    return next(r for r in records_from_index(read_index(directory)) if r.fqn == fqn)


def _entry_data_offset(item: bytes, suffix: str) -> int:
    """Offset within a torch.save item of the bytes of its zip record ending in ``suffix``."""
    info = next(i for i in zipfile.ZipFile(io.BytesIO(item)).infolist() if i.filename.endswith(suffix))
    name_nbytes, extra_nbytes = struct.unpack_from("<HH", item, info.header_offset + 26)
    return info.header_offset + 30 + name_nbytes + extra_nbytes


def test_verify_deep_calls_a_plain_dcp_checkpoint_with_optimizer_state_and_an_int_sound(tmp_path):
    dcp.save(trained_state(), checkpoint_id=str(tmp_path / "d"), no_dist=True)
    index = read_index(tmp_path / "d")
    assert "iteration" in index.objects and "optim.param_groups.0.betas" in index.objects

    report = verify_checkpoint(tmp_path / "d", deep=True)
    assert report.ok and report.status == "OK", report.findings
    assert report.items_decoded == report.items == len(index.tensors) + len(index.objects)
    run = _cli("verify", "--deep", str(tmp_path / "d"))
    assert run.returncode == 0 and ": OK" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize(
    "fqn, record",
    [("iteration", "data.pkl"), ("optim.param_groups.0.betas", "data.pkl"), ("optim.state.0.weight.exp_avg", "data/0")],
)
def test_verify_deep_still_finds_a_flipped_bit_in_a_plain_dcp_checkpoint(tmp_path, fqn, record):
    """torch DCP records no per-item checksum, but each item's zip does: a flipped bit in a byte
    item's pickle or in a tensor's elements is damage (the tensor one decodes fine otherwise)."""
    dcp.save(trained_state(), checkpoint_id=str(tmp_path / "d"), no_dist=True)
    rec = _record(tmp_path / "d", fqn)
    path = tmp_path / "d" / rec.relative_path
    item = path.read_bytes()[rec.file_offset : rec.file_offset + rec.length]
    flip_bit(path, rec.file_offset + _entry_data_offset(item, "/" + record) + 1, bit=2)

    report = verify_checkpoint(tmp_path / "d", deep=True)
    [err] = [f for f in report.findings if f.severity == ERROR]
    assert report.status == "DAMAGED" and err.check == "decode" and err.file == rec.relative_path
    assert err.item.startswith(fqn) and (err.offset, err.length) == (rec.file_offset, rec.length)
    assert f"record archive/{record}" in err.message and "CRC-32" in err.message and "damaged" in err.message
    assert verify_checkpoint(tmp_path / "d").ok  # without --deep only presence and length are checked


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
        ckptd.load(
            {"model.0.weight": ShardedTensor.from_rank_offsets("model.0.weight", torch.zeros_like(w))}, tmp_path / "z"
        )
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
