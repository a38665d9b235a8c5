"""Block checksums through the daemon: a save's item over one 4 MiB block records the CRC-32C of
each block (in WRITTEN, then in ``.metadata``), equal to those of the bytes on disk, and a load of
part of the item checks the blocks it read, and those of the headers it found them through. Real
daemon, real files."""

from __future__ import annotations

import pytest
import torch

import ckptd
from ckptd import CorruptCheckpointError, LoadStats, ShardedTensor
from ckptd.format.checksum import BLOCK_NBYTES, crc32c, unpack_blocks
from ckptd.format.dcp_metadata import read_index
from tests.checkpoints import flip_bit


@pytest.mark.timeout(120)
def test_the_daemon_records_block_checksums_and_a_partial_load_checks_them(tmp_path, single_process, runtime_dir):
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=3.0)
    w = torch.randn(640, 4096)  # 10 MiB: three blocks
    with ckptd.Checkpointer(tmp_path / "run", config=cfg) as ckpt:
        ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=1).wait(timeout_s=60)
    ck = tmp_path / "run" / "iter_0000001"
    c = read_index(ck).tensors["w"].chunks[0]
    data = (ck / c.relative_path).read_bytes()[c.file_offset : c.file_offset + c.length]
    blocks = [data[i : i + BLOCK_NBYTES] for i in range(0, len(data), BLOCK_NBYTES)]
    assert len(blocks) == 3 and unpack_blocks(c.block_crcs) == tuple(crc32c(b) for b in blocks)
    assert c.crc == crc32c(data)

    def rows(first: bool) -> dict:  # rows 0..319 or 320..639
        return {"w": ShardedTensor.from_rank_offsets("w", torch.empty(320, 4096), (0, 0 if first else 1, 2))}

    stats = LoadStats()
    assert torch.equal(ckptd.load(rows(True), ck, stats=stats)["w"], w[:320]) and stats.items_verified == 1
    at = c.file_offset + c.length - 4096  # in block 2, which rows 320.. end in
    flip_bit(ck / c.relative_path, at)
    with pytest.raises(CorruptCheckpointError, match=r"block 2 \(bytes"):
        ckptd.load(rows(False), ck)
    # Block 2 also holds the zip's directory, which rows 0..319 were found through.
    with pytest.raises(CorruptCheckpointError, match=r"block 2 \(bytes"):
        ckptd.load(rows(True), ck)
    flip_bit(ck / c.relative_path, at)

    # The elements' record's local header (in block 0): its extra field's length, one bit up,
    # moves where the elements seem to start by 64 bytes, still inside the item. Rows 320.. lie in
    # blocks 1 and 2, which are intact: before, they loaded shifted by 16 values, silently.
    name = data.index(b"/data/0")
    header = data.rindex(b"PK\x03\x04", 0, name)
    assert header < BLOCK_NBYTES
    flip_bit(ck / c.relative_path, c.file_offset + header + 28, bit=6)
    with pytest.raises(CorruptCheckpointError, match=r"block 0 \(bytes"):
        ckptd.load(rows(False), ck)
