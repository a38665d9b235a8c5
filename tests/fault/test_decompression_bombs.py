"""Crafted torch.save archives (issue 25 M6): what decoding ``common.pt`` or an item allocates is
bounded by its bytes on disk. Records compressed with deflate (torch.save never compresses), torch's
legacy format, storages larger than their records and size-taking constructors (``bytearray(n)``,
``torch.FloatStorage(n)``) are refused as CorruptCheckpointError by every reader: load,
load_common_state_dict, latest() (the structural check), verify and inspect; ordinary common state
still decodes."""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

import ckptd
from ckptd import CorruptCheckpointError, ShardedObject, ShardedTensor
from ckptd.describe import describe_checkpoint
from ckptd.format.archive import decode_problem
from ckptd.format.dcp_metadata import CHECKSUMS_ATTR
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tracker_bytes
from ckptd.recovery import resolve_latest
from ckptd.verify import verify_checkpoint

ST = ShardedTensor
BIG = 16 << 20  # zeros that deflate to ~64 KiB


def saved(obj: object, **kwargs) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def deflated(data: bytes) -> bytes:
    """The same archive with every record compressed (what torch.load inflates without a bound)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    return out.getvalue()


class _Call:
    """Pickles as a call of ``fn(*args)``: what a hostile pickle can ask the weights-only unpickler."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def short_record(data: bytes) -> bytes:
    """A tensor archive whose data record holds 8 bytes for a storage of 1,000 floats."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            raw = src.read(info.filename)
            dst.writestr(info.filename, raw[:8] if info.filename.endswith("/data/0") else raw)
    return out.getvalue()


BOMBS = {
    "deflated": (deflated(saved({"iteration": 1, "big": torch.zeros(BIG)})), "is compressed"),
    "legacy": (saved({"iteration": 1}, _use_new_zipfile_serialization=False), "legacy format"),
    "bytearray": (saved({"iteration": 1, "x": _Call(bytearray, 1 << 62)}), "calls builtins.bytearray"),
    "storage": (saved({"iteration": 1, "x": _Call(torch.FloatStorage, 1 << 60)}), "calls torch.FloatStorage"),
    # torch's rebuild of a tensor subclass calls the legacy constructor itself (weights-only allowed).
    "rebuild from type": (
        saved(
            {
                "iteration": 1,
                "x": _Call(torch._tensor._rebuild_from_type_v2, torch.FloatTensor, torch.Tensor, (3 << 30,), {}),
            }
        ),
        "calls torch.FloatTensor",
    ),
    "short record": (short_record(saved(torch.arange(1000, dtype=torch.float32))), "declares storage '0' of 1000"),
}


def checkpoint(path: Path, sd: dict | None = None) -> Path:
    """A ckptd checkpoint without recorded checksums, as Megatron-Core writes them (no CRC of
    common.pt or an item could tell a replaced one)."""
    sd = sd or {
        "w": ST.from_rank_offsets("w", torch.arange(6.0)),
        "o": ShardedObject("o", {"a": 1}, (1,), (0,)),
        "iteration": 1,
    }
    ckptd.save(sd, path, checksums=False)
    md = pickle.loads((path / ".metadata").read_bytes())
    if hasattr(md, CHECKSUMS_ATTR):
        delattr(md, CHECKSUMS_ATTR)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return path


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_crafted_common_pt_is_refused_by_every_reader(tmp_path, bomb):
    data, why = BOMBS[bomb]
    root = tmp_path / "r"
    older = checkpoint(root / step_dir_name(1))
    newer = checkpoint(root / step_dir_name(2))
    (root / TRACKER_FILE).write_bytes(tracker_bytes(newer.name))
    (newer / "common.pt").write_bytes(data)
    req = {"w": ST.from_rank_offsets("w", torch.empty(6))}
    with pytest.raises(CorruptCheckpointError, match=why):  # before: inflated, allocated, or a raw error
        ckptd.load(req, newer)
    with pytest.raises(CorruptCheckpointError, match=why):
        ckptd.load_common_state_dict(newer)
    report = verify_checkpoint(newer)
    assert report.status == "DAMAGED" and any(why in f.message for f in report.errors), report.findings
    assert resolve_latest(root).entry.path == older  # latest() falls back to the intact one
    assert why in describe_checkpoint(newer).common_note


def replace_item(ckpt: Path, fqn: str, data: bytes) -> None:
    """Store ``data`` as item ``fqn``: appended to its data file, ``.metadata`` pointing at it."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    (idx,) = [i for i in md.storage_data if i.fqn == fqn]
    rel = md.storage_data[idx].relative_path
    with open(ckpt / rel, "ab") as f:
        offset = f.tell()
        f.write(data)
    md.storage_data[idx] = _StorageInfo(rel, offset, len(data))
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def test_compressed_items_are_refused_at_load(tmp_path):
    ckpt = checkpoint(tmp_path / "c")
    replace_item(ckpt, "o/shard_0_1", deflated(saved([bytes(BIG)])))
    with pytest.raises(CorruptCheckpointError, match=r"ShardedObject 'o/shard_0_1'.*is compressed"):
        ckptd.load({"o": ShardedObject("o", None, (1,), (0,))}, ckpt)
    checkpoint(tmp_path / "d", {"w": torch.arange(6.0), "v": 3})  # DCP-style: a value item
    replace_item(tmp_path / "d", "v", deflated(saved(bytes(BIG))))
    with pytest.raises(CorruptCheckpointError, match=r"the value 'v'.*is compressed"):
        ckptd.load({"w": torch.empty(6), "v": 0}, tmp_path / "d")
    checkpoint(tmp_path / "t", {"t": ST.from_rank_offsets("t", torch.zeros(4))})
    replace_item(tmp_path / "t", "t", deflated(saved(torch.zeros(4))))  # read through torch.load, not raw
    with pytest.raises(CorruptCheckpointError, match=r"tensor 't'.*is compressed"):
        ckptd.load({"t": ST.from_rank_offsets("t", torch.empty(4))}, tmp_path / "t")


def test_ordinary_common_state_passes_the_check():
    """The scan must not refuse what real checkpoints hold (Megatron-LM's args, optimizer state,
    RNG state, numbers of every kind, byte strings)."""
    ns = argparse.Namespace(lr=0.1, layers=[1, 2], name="gpt")
    state = {
        "iteration": 12,
        "args": ns,
        "rng": {"cpu": torch.get_rng_state(), "py": (3, tuple(range(5)), None)},
        "opt": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}], "state": {}},
        "od": collections.OrderedDict(a=torch.arange(3), b=torch.nn.Parameter(torch.ones(2))),
        "misc": {1.5, 2.5},
        "blob": bytearray(b"abc" * 100),
        "c": complex(1, 2),
        "view": torch.arange(10.0)[2:5],
        "size": torch.Size([2, 3]),
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        # two elements a byte: more elements than the stream has bytes (a size check in elements refused it)
        "q4": torch.quantize_per_tensor(torch.rand(100_000), 0.1, 0, torch.quint4x2),
        "subclass": torch.nn.Parameter(torch.ones(4)),
    }
    data = saved(state)
    assert decode_problem(io.BytesIO(data)) is None
    assert decode_problem(io.BytesIO(saved(torch.zeros(BIG)))) is None  # large, but all on disk
