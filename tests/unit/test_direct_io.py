"""Data files written around the page cache (ckptd.format.direct) hold exactly the bytes written."""

from __future__ import annotations

import io
import os
import tempfile

import crc32c
import pytest
import torch

from ckptd.format.direct import DIRECT_ALIGN, DirectFile, buffer_address
from ckptd.format.items import PlannedItem, plan_object, write_data_file
from ckptd.format.records import TENSOR, ItemRecord
from ckptd.mapping import ShardedObject


def _direct_capable(directory) -> bool:
    with DirectFile(str(directory / "probe")) as f:
        return f.direct_alignment > 0


def test_buffer_address_matches_tensor_pointer():
    t = torch.arange(1000, dtype=torch.int32)
    view = memoryview(t.numpy()).cast("B")
    assert buffer_address(view) == t.data_ptr()
    assert buffer_address(view[12:]) == t.data_ptr() + 12
    assert buffer_address(b"readonly") != 0


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_direct_file_writes_exactly_the_bytes(tmp_path, where):
    if where == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        directory = type(tmp_path)(tempfile.mkdtemp(prefix="ckptd-test-direct-", dir="/dev/shm"))
    else:
        directory = tmp_path
    try:
        big = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
        expected = bytearray()
        path = str(directory / "f.bin")
        with DirectFile(path) as f:
            for chunk in (b"header", memoryview(big.numpy())[5:], b"x" * 100, memoryview(big.numpy())):
                f.write(chunk)
                expected += bytes(chunk)
            f.skip_to(f.tell() + 777)
            expected += bytes(777)
            f.write(b"tail")
            expected += b"tail"
            assert f.tell() == len(expected)
            direct = f.direct_nbytes
        with open(path, "rb") as r:
            assert r.read() == bytes(expected)
        if where == "shm":
            assert direct == 0  # tmpfs refuses O_DIRECT: all buffered, still exact
    finally:
        if where == "shm":
            for name in os.listdir(directory):
                os.unlink(directory / name)
            os.rmdir(directory)


def test_items_land_aligned_and_load(tmp_path):
    if not _direct_capable(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4 << 20, generator=gen)
    payloads = [
        base[: 1 << 20],  # page-aligned start
        base[(1 << 20) + 3 : (2 << 20) + 3],  # starts 12 bytes into a page
        torch.arange(10, dtype=torch.int64),  # small: no alignment needed
        base[(3 << 20) : (3 << 20) + 300_001],  # odd length
    ]
    items = [
        PlannedItem(
            ItemRecord(
                fqn=f"t{i}",
                kind=TENSOR,
                rank=0,
                dtype="float32" if p.dtype == torch.float32 else "int64",
                global_shape=tuple(p.shape),
                offsets=(0,),
                sizes=tuple(p.shape),
            ),
            p,
        )
        for i, p in enumerate(payloads)
    ]
    items.append(plan_object(ShardedObject("obj", {"a": 1}, (1,), (0,)), 0))
    stored = write_data_file(tmp_path, "f.distcp", items)
    data = (tmp_path / "f.distcp").read_bytes()
    ends = 0
    for rec, item in zip(stored, items):
        assert rec.file_offset >= ends  # items never overlap; gaps are allowed
        ends = rec.file_offset + rec.length
        blob = data[rec.file_offset : ends]
        assert rec.crc == crc32c.crc32c(blob), rec.fqn
        loaded = torch.load(io.BytesIO(blob), weights_only=False)
        if isinstance(item.payload, torch.Tensor):
            assert torch.equal(loaded, item.payload), rec.fqn
            raw = item.payload.numpy().tobytes()
            at = blob.find(raw[:4096])
            # The storage sits at a file offset congruent to its address: the O_DIRECT path ran.
            if len(raw) >= 1 << 20:
                assert (rec.file_offset + at) % DIRECT_ALIGN == item.payload.data_ptr() % DIRECT_ALIGN
    assert ends == len(data)


def test_direct_and_buffered_files_load_the_same(tmp_path):
    """Same items, with and without O_DIRECT: every item decodes to the same tensor."""
    t = torch.randn(2 << 20)
    items = [
        PlannedItem(
            ItemRecord(
                fqn="w", kind=TENSOR, rank=0, dtype="float32", global_shape=(2 << 20,), offsets=(0,), sizes=(2 << 20,)
            ),
            t,
        )
    ]
    direct = write_data_file(tmp_path, "a.distcp", items)
    buffered = write_data_file(tmp_path, "b.distcp", items, opener=lambda p, m: open(p, m))  # noqa: SIM115 - the writer closes it
    for name, rec in (("a.distcp", direct[0]), ("b.distcp", buffered[0])):
        blob = (tmp_path / name).read_bytes()[rec.file_offset : rec.file_offset + rec.length]
        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)


def test_a_large_piece_written_buffered_is_not_copied_first():
    """Where O_DIRECT is refused (tmpfs), each item was appended to a buffer before its pwrite:
    the daemon held a copy of every item being written (1 GiB more to write a 1 GiB item)."""
    import tracemalloc

    # Off by one byte from an aligned allocation, after 4 bytes: no O_DIRECT request can be
    # aligned on both sides, so the piece goes the buffered way also where O_DIRECT is accepted.
    data = torch.arange(16 << 20, dtype=torch.uint8)[1:]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        path = os.path.join(d, "f")
        tracemalloc.start()
        try:
            with DirectFile(path) as f:
                f.write(b"head")
                f.write(data.numpy())
                f.write(b"tail")
                assert f.direct_nbytes == 0
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        with open(path, "rb") as got:
            assert got.read() == b"head" + data.numpy().tobytes() + b"tail"
    assert peak < 4 << 20, peak
