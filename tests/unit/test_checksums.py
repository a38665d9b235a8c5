"""Per-item CRC-32 checksums: computed while writing, kept in .metadata, read back into the index."""

import io
import pickle
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import crc32c
import msgpack
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptd
from ckptd.control.codec import Codec
from ckptd.control.protocol import PROTOCOL_VERSION, MsgType, Written
from ckptd.errors import CorruptCheckpointError
from ckptd.format.checksum import TABLE_VERSION
from ckptd.format.dcp_metadata import CHECKSUMS_ATTR, build_metadata, read_index, records_from_index, write_metadata
from ckptd.format.items import PlannedItem, plan_object, write_data_file
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.mapping import ShardedObject
from tests.checkpoints import make_checkpoint
from tests.messages import a_written


def _items() -> list[PlannedItem]:
    big = torch.randn(1 << 19)  # 2 MiB: checksummed on the helper thread while it is written
    strided = torch.arange(48, dtype=torch.int64).reshape(6, 8)[:, ::2]  # non-contiguous: copied
    view = torch.arange(100, dtype=torch.float16)[10:30]  # a slice of a larger storage
    out = []
    for i, t in enumerate((big, strided, view)):
        rec = ItemRecord(
            fqn=f"t{i}",
            kind=TENSOR,
            rank=0,
            dtype=str(t.dtype).removeprefix("torch."),
            global_shape=tuple(t.shape),
            offsets=(0,) * t.dim(),
            sizes=tuple(t.shape),
        )
        out.append(PlannedItem(rec, t))
    out.append(plan_object(ShardedObject("obj", {"a": [1, 2]}, (1,), (0,)), 0))
    return out


def _zip_crcs(item: bytes) -> list[int]:
    with zipfile.ZipFile(io.BytesIO(item)) as z:
        return [info.CRC for info in z.infolist()]


def _write_on_thread(*args, **kwargs):
    """write_data_file on a fresh thread, as the daemon's writer pool runs it."""
    with ThreadPoolExecutor(1) as ring:
        return ring.submit(write_data_file, *args, **kwargs).result()


def test_crc_covers_exactly_each_items_bytes_and_replaces_the_zip_crc(tmp_path):
    items = _items()
    # On a writer thread: torch keeps its zip-CRC switch per thread (a context variable).
    on = _write_on_thread(tmp_path, "on.distcp", items, fsync=False, checksums=True)
    off = write_data_file(tmp_path, "off.distcp", items, fsync=False, checksums=False)
    data, plain = (tmp_path / "on.distcp").read_bytes(), (tmp_path / "off.distcp").read_bytes()
    for rec in on:
        assert rec.crc == crc32c.crc32c(data[rec.file_offset : rec.file_offset + rec.length]), rec.fqn
    assert [r.crc for r in off] == [None] * len(items)
    assert [(r.file_offset, r.length) for r in on] == [(r.file_offset, r.length) for r in off]
    for rec, item in zip(on, items):
        mine = data[rec.file_offset : rec.file_offset + rec.length]
        theirs = plain[rec.file_offset : rec.file_offset + rec.length]
        if rec.kind == TENSOR:
            # One checksum per byte: ckptd's, not also torch's zip CRC (~11 ms per 64 MiB).
            assert set(_zip_crcs(mine)) == {0}, rec.fqn
            assert 0 not in _zip_crcs(theirs), rec.fqn
            # The items still decode as DCP would read them (torch does not check zip CRCs).
            loaded = torch.load(io.BytesIO(mine), weights_only=True)
            assert torch.equal(loaded, item.payload.contiguous()), rec.fqn
        else:
            assert mine == theirs  # pickled objects are serialized before, by the rank
    # The switch is scoped: torch.save elsewhere still writes zip CRCs.
    from torch.utils.serialization import config

    assert config.save.compute_crc32


def test_record_wire_format_keeps_crc_and_reads_old_records():
    rec = ItemRecord(
        fqn="w",
        kind=TENSOR,
        rank=3,
        dtype="float32",
        global_shape=(4,),
        offsets=(0,),
        sizes=(4,),
        relative_path="__3_0.distcp",
        file_offset=0,
        length=100,
        crc=0xDEADBEEF,
    )
    codec = Codec("job")

    def through_the_wire(*records: object) -> list[ItemRecord]:
        body = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "t": int(MsgType.WRITTEN),
                "job": "job",
                "f": asdict(a_written(rank=3, world_size=4)),
            },
            use_bin_type=True,
        )
        envelope = msgpack.unpackb(body)
        envelope["f"]["records"] = list(records)
        msg = codec.decode([msgpack.packb(envelope, use_bin_type=True)])
        assert isinstance(msg, Written)
        return msg.records

    assert codec.decode(codec.encode(a_written(rank=3, world_size=4, records=[rec]))) == a_written(
        rank=3, world_size=4, records=[rec]
    )
    old = {k: v for k, v in asdict(rec).items() if k != "crc"}  # a record from before checksums
    assert through_the_wire(old) == [replace(rec, crc=None)]
    assert through_the_wire(asdict(rec.stored_at("f", 1, 2)))[0].crc is None


def test_checksums_land_in_metadata_and_index(tmp_path):
    make_checkpoint(tmp_path / "c")
    raw = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    table = getattr(raw, CHECKSUMS_ATTR)
    assert table["algorithm"] == "crc32c" and table["version"] == 2
    assert table["files"]["common.pt"] == crc32c.crc32c((tmp_path / "c" / "common.pt").read_bytes())
    index = read_index(tmp_path / "c")
    assert index.has_checksums and index.common_crc == table["files"]["common.pt"]
    records = records_from_index(index)
    assert len(records) == len(table["items"]) == 6
    for r in records:
        data = (tmp_path / "c" / r.relative_path).read_bytes()[r.file_offset : r.file_offset + r.length]
        assert r.crc == crc32c.crc32c(data), r.fqn
        key = (r.fqn, tuple(r.offsets) if r.kind == TENSOR else ())
        assert table["items"][key] == r.crc


def test_no_checksums_means_no_table(tmp_path):
    recs = [ItemRecord(fqn="o", kind=BYTES, rank=0, relative_path="__0_0.distcp", file_offset=0, length=3)]
    assert not hasattr(build_metadata(recs), CHECKSUMS_ATTR)
    make_checkpoint(tmp_path / "c", checksums=False)
    index = read_index(tmp_path / "c")
    assert all(r.crc is None for r in records_from_index(index))
    assert index.common_crc is not None  # common.pt is always checksummed (cheap, written whole)


def test_malformed_checksum_table_is_a_corrupt_checkpoint(tmp_path):
    make_checkpoint(tmp_path / "c")
    md = read_index(tmp_path / "c").raw
    setattr(md, CHECKSUMS_ATTR, {"version": 1, "algorithm": "crc32", "items": [1, 2]})
    write_metadata(tmp_path / "c", md, fsync=False)
    with pytest.raises(CorruptCheckpointError, match="checksum table"):
        read_index(tmp_path / "c")


def test_checksum_table_of_a_newer_version_is_loaded_without_checksums(tmp_path, caplog):
    """Refusing it would make a resume after a ckptd downgrade skip every newer checkpoint (and the
    next commit leave them to retention)."""
    ref = make_checkpoint(tmp_path / "c")
    md = read_index(tmp_path / "c").raw
    setattr(md, CHECKSUMS_ATTR, {"version": TABLE_VERSION + 1, "algorithm": "xxh3", "items": {}})
    write_metadata(tmp_path / "c", md, fsync=False)
    index = read_index(tmp_path / "c")
    assert index.common_crc is None and all(r.crc is None for r in records_from_index(index))
    assert torch.equal(ckptd.load_plain_tensors(tmp_path / "c")["layer.bias"], ref["layer.bias"])
    assert f"checksum table of version {TABLE_VERSION + 1}, newer than this ckptd's" in caplog.text


@pytest.mark.parametrize("version, algorithm", [(TABLE_VERSION, "crc32s"), ("2", "crc32c"), (0, "crc32c")])
def test_a_checksum_table_no_ckptd_writes_is_damage(tmp_path, version, algorithm):
    """A flipped bit in the table's algorithm, or one that makes its version another type or an
    older version no ckptd wrote, loaded the checkpoint without any checksum (bit rot passed)."""
    make_checkpoint(tmp_path / "c")
    md = read_index(tmp_path / "c").raw
    table = getattr(md, CHECKSUMS_ATTR)
    setattr(md, CHECKSUMS_ATTR, {**table, "version": version, "algorithm": algorithm})
    write_metadata(tmp_path / "c", md, fsync=False)
    with pytest.raises(CorruptCheckpointError, match="which no ckptd writes; the file is damaged"):
        read_index(tmp_path / "c")


def test_torch_dcp_loads_a_checkpoint_with_checksums(tmp_path):
    ref = make_checkpoint(tmp_path / "c")
    out = {k: torch.empty_like(v) for k, v in ref.items()}
    dcp.load(out, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    for k, v in ref.items():
        assert torch.equal(out[k], v), k
    # and ckptd itself, with and without checksums recorded
    assert torch.equal(ckptd.load_plain_tensors(tmp_path / "c")["layer.weight"], ref["layer.weight"])


def test_sync_save_switch(tmp_path):
    x = torch.randn(3, 3)
    ckptd.save({"x": ckptd.ShardedTensor.from_rank_offsets("x", x)}, tmp_path / "a", checksums=False)
    ckptd.save({"x": ckptd.ShardedTensor.from_rank_offsets("x", x)}, tmp_path / "b")
    assert read_index(tmp_path / "a").tensors["x"].chunks[0].crc is None
    assert read_index(tmp_path / "b").tensors["x"].chunks[0].crc is not None


def test_checkpoints_with_crc32_tables_of_older_versions_still_verify(tmp_path):
    """Version-1 tables (zlib CRC-32, written before CRC-32C) verify with zlib; damage is found."""
    import zlib

    from ckptd.format.dcp_metadata import write_metadata
    from ckptd.verify import verify_checkpoint

    c = tmp_path / "c"
    make_checkpoint(c)
    raw = pickle.loads((c / ".metadata").read_bytes())
    index = read_index(c)
    items = {}
    for r in records_from_index(index):
        data = (c / r.relative_path).read_bytes()[r.file_offset : r.file_offset + r.length]
        items[(r.fqn, tuple(r.offsets) if r.kind == TENSOR else ())] = zlib.crc32(data)
    setattr(
        raw,
        CHECKSUMS_ATTR,
        {
            "version": 1,
            "algorithm": "crc32",
            "items": items,
            "files": {"common.pt": zlib.crc32((c / "common.pt").read_bytes())},
        },
    )
    (c / ".metadata").unlink()
    write_metadata(c, raw, fsync=False)
    report = verify_checkpoint(c, deep=True)
    assert report.ok and report.items_checksummed == len(items) and report.items_without_checksum == 0, report
    r = next(r for r in records_from_index(read_index(c)) if r.kind == TENSOR)
    with open(c / r.relative_path, "r+b") as f:
        f.seek(r.file_offset + r.length - 1)
        byte = f.read(1)
        f.seek(r.file_offset + r.length - 1)
        f.write(bytes([byte[0] ^ 1]))
    assert not verify_checkpoint(c).ok
