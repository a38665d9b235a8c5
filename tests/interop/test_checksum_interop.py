"""Checksummed ckptd checkpoints still load with Megatron-Core and torch DCP, and ``verify``
accepts Megatron-Core's own checkpoints (which carry no checksums).

One real subprocess (a one-rank gloo group: Megatron-Core needs a process group, and its save
starts a multiprocessing Manager, which a daemonic worker of tools.harness.ranks may not) does the
Megatron-Core and DCP jobs; the checks of the results run here.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptd.format.dcp_metadata import CHECKSUMS_ATTR
from ckptd.verify import NOTE, verify_checkpoint
from tests.checkpoints import WORLD, make_checkpoint, reference_tensors
from tests.megatron_rank import megatron_save_on_cpu

REPO = Path(__file__).resolve().parents[2]


def megatron_jobs(ckptd_dir: str, megatron_dir: str, result_file: str) -> None:
    """Entry point of the subprocess."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ref = reference_tensors()
    # 1. Megatron-Core loads the ckptd checkpoint (which has a checksum table in .metadata).
    request = {k: mdc.ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in ref.items()}
    for r in range(WORLD):
        request[f"rng{r}"] = ShardedObject("rng", None, (WORLD,), (r,))
    loaded = mdc.load(request, ckptd_dir)
    # 2. torch DCP loads it too (its own reader, its own unpickling of .metadata).
    plain = {k: torch.empty_like(v) for k, v in ref.items()}
    dcp.load(plain, checkpoint_id=ckptd_dir)
    # 3. Megatron-Core writes a checkpoint of its own (on CPU).
    megatron_save_on_cpu()
    own = {k: mdc.ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in ref.items()}
    own["rng"] = ShardedObject("rng", {"seed": 1}, (1,), (0,))
    own["iteration"] = 3
    mdc.save(own, megatron_dir)
    dist.destroy_process_group()
    Path(result_file).write_text(
        json.dumps(
            {
                "megatron": {k: bool(torch.equal(loaded[k], v)) for k, v in ref.items()},
                "objects": [loaded[f"rng{r}"] for r in range(WORLD)],
                "common": loaded.get("iteration"),
                "dcp": {k: bool(torch.equal(plain[k], v)) for k, v in ref.items()},
            }
        )
    )


@pytest.mark.timeout(180)
def test_checksums_are_invisible_to_megatron_core_and_dcp(tmp_path: Path):
    make_checkpoint(tmp_path / "ckptd", step=11)
    assert getattr(pickle.loads((tmp_path / "ckptd" / ".metadata").read_bytes()), CHECKSUMS_ATTR)["items"]
    (tmp_path / "megatron").mkdir()
    code = (
        "from tests.interop.test_checksum_interop import megatron_jobs; "
        f"megatron_jobs({str(tmp_path / 'ckptd')!r}, {str(tmp_path / 'megatron')!r}, "
        f"{str(tmp_path / 'result.json')!r})"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert all(res["megatron"].values()) and all(res["dcp"].values()), res
    assert res["objects"] == [{"rank": r, "seed": 1234 + r} for r in range(WORLD)]
    assert res["common"] == 11
    # ckptd verify on Megatron-Core's checkpoint: sound, items decode, the missing checksums noted.
    report = verify_checkpoint(tmp_path / "megatron", deep=True)
    assert report.ok, report.findings
    assert report.items_without_checksum == report.items == 4 and report.items_decoded == 4
    assert any(f.severity == NOTE and "no recorded checksum" in f.message for f in report.findings)


@pytest.mark.parametrize("writer", ["torch DCP", "ckptd, checksums=False"])
def test_bit_rot_in_a_tensor_without_a_recorded_checksum_fails_the_load(tmp_path: Path, writer: str):
    """A checkpoint without ckptd's checksums (torch DCP's, Megatron-Core's, ``checksums=False``):
    a flipped bit in a tensor's elements loaded without a word (its common state and bytes items
    were checked against their archives' CRC-32s, its tensors were not). A whole item is checked
    against the CRC-32 its ``torch.save`` archive records; one read in part counts as unverified,
    or with ``verify_partial`` is read whole and checked."""
    import torch.distributed.checkpoint as dcp

    import ckptd
    from ckptd import ShardedTensor
    from ckptd.errors import CorruptCheckpointError
    from ckptd.format.dcp_metadata import read_index
    from ckptd.loading.execute import LoadStats
    from ckptd.loading.rawitem import locate

    full = torch.arange(300 * 70, dtype=torch.float32).reshape(300, 70)
    d = tmp_path / "c"
    if writer == "torch DCP":
        dcp.save({"w": full.clone()}, checkpoint_id=str(d))
    else:
        ckptd.save({"w": full.clone()}, d, checksums=False)
    stats = LoadStats()
    whole = torch.zeros(300, 70)
    ckptd.load({"w": whole}, d, stats=stats)
    assert torch.equal(whole, full) and stats.items_verified == 1
    chunk = read_index(d).tensors["w"].chunks[0]
    path = d / chunk.relative_path
    with open(path, "r+b") as f:
        layout = locate(
            lambda off, n: os.pread(f.fileno(), n, off), chunk.file_offset, chunk.length, torch.float32, (300, 70)
        )
        assert layout is not None and layout.record_crc32 is not None
        at = layout.data_offset + (123 * 70 + 4) * 4 + 3  # an exponent bit of w[123, 4]
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(CorruptCheckpointError, match=r"CRC-32 .* torch.save archive records"):
        ckptd.load({"w": torch.zeros(300, 70)}, d)

    def half() -> dict:  # rows 0-149: the item read in part
        return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(150, 70), (0, 0, 2))}

    stats = LoadStats()
    ckptd.load(half(), d, stats=stats)
    assert stats.items_unverified == 1 and stats.items_verified == 0
    with pytest.raises(CorruptCheckpointError, match="CRC-32"):
        ckptd.load(half(), d, verify_partial=True)
