"""A ``.metadata`` that contradicts the data (issue 25 M7): shapes or dtypes whose bytes the items
do not hold are CorruptCheckpointError before anything is allocated, in loads, in
``ckptd convert consolidate``, in the default ``ckptd verify`` and in the structural check that
latest() runs."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CorruptCheckpointError, ShardedTensor
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.recovery import resolve_latest
from ckptd.verify import verify_checkpoint
from tests.cli import offline_cli
from tests.multiproc import without_torchrun

HUGE = 1 << 40  # rows: 2^40 x 256 float32 is 1 PiB


def edit_metadata(ckpt: Path, fn: Callable) -> None:
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    fn(md.state_dict_metadata["w"])
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def huge_chunk(t) -> None:
    t.size = torch.Size([HUGE, 256])
    t.chunks[0].sizes = torch.Size([HUGE, 256])


def float64(t) -> None:
    t.properties.dtype = torch.float64


def huge_global(t) -> None:
    t.size = torch.Size([HUGE, 256])  # the one chunk stays 64 x 256


def save_root(root: Path) -> tuple[Path, Path]:
    for step in (1, 2):
        ckptd.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.randn(64, 256)), "it": step}, root / step_dir_name(step)
        )
    (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(2)))
    return root / step_dir_name(1), root / step_dir_name(2)


@pytest.mark.parametrize("edit", [huge_chunk, float64])
def test_a_chunk_whose_bytes_its_item_lacks_is_damage_everywhere(tmp_path, edit):
    older, newer = save_root(tmp_path / "r")
    edit_metadata(newer, edit)
    for read in (ckptd.load_plain_tensors, ckptd.load_tensors_metadata):
        with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' chunk at \(0, 0\).*holds only \d+ bytes"):
            read(newer)  # before: a raw RuntimeError (an allocation of 1 PiB), or the metadata as it said
    report = verify_checkpoint(newer)  # the default (items checksummed, not decoded)
    assert report.status == "DAMAGED" and "contradicts the data" in report.errors[0].message
    assert resolve_latest(tmp_path / "r").entry.path == older  # before: the damaged one


def test_a_global_shape_the_chunks_do_not_hold_is_refused_before_allocating(tmp_path):
    _, newer = save_root(tmp_path / "r")
    edit_metadata(newer, huge_global)
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w'.*hold 6\d{4} bytes.*Nothing was allocated"):
        ckptd.load_plain_tensors(newer)  # before: RuntimeError, can't allocate 1 PiB
    with pytest.raises(CorruptCheckpointError, match="Nothing was allocated"):
        ckptd.load(ckptd.load_tensors_metadata(newer), newer)
    assert verify_checkpoint(newer).status == "DAMAGED"  # the chunk leaves a gap


@pytest.mark.timeout(120)
def test_consolidate_reports_it_without_a_traceback(tmp_path):
    _, newer = save_root(tmp_path / "r")
    edit_metadata(newer, huge_global)
    run = offline_cli("convert", "consolidate", newer, tmp_path / "out.pt", env=without_torchrun(os.environ))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr and "Nothing was allocated" in run.stderr
    assert not (tmp_path / "out.pt").exists()
