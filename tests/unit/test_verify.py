"""ckptd.verify on real checkpoints, sound and damaged in every way verify promises to catch."""

import argparse
import dataclasses
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo

import ckptd
from ckptd.format.dcp_metadata import build_metadata, read_index, records_from_index, write_metadata
from ckptd.format.records import TENSOR
from ckptd.verify import ERROR, NOTE, WARNING, verify_checkpoint
from tests.checkpoints import flip_bit, make_checkpoint, reference_tensors


def _errors(report):
    return [f for f in report.findings if f.severity == ERROR]


def _record(directory, fqn, offsets=None):
    for r in records_from_index(read_index(directory)):
        if r.fqn == fqn and (offsets is None or tuple(r.offsets) == offsets):
            return r
    raise KeyError(fqn)


def test_sound_checkpoint_passes_every_check(tmp_path):
    make_checkpoint(tmp_path / "c")
    report = verify_checkpoint(tmp_path / "c", deep=True)
    assert report.ok, report.findings
    assert report.findings == []
    assert (report.tensors, report.objects, report.items, report.data_files) == (3, 2, 6, 2)
    assert report.items_checksummed == 6 and report.items_decoded == 6
    data_bytes = sum(os.path.getsize(tmp_path / "c" / f"__{r}_0.distcp") for r in (0, 1))
    assert report.bytes_read == data_bytes + os.path.getsize(tmp_path / "c" / "common.pt")
    assert report.to_dict()["ok"] is True


def test_bit_flip_in_tensor_data_is_a_checksum_error_naming_the_item(tmp_path):
    ref = make_checkpoint(tmp_path / "c")
    rec = _record(tmp_path / "c", "layer.weight", (4, 0))  # rank 1's half
    path = tmp_path / "c" / rec.relative_path
    raw = ref["layer.weight"][4:].numpy().tobytes()
    at = path.read_bytes().find(raw, rec.file_offset)
    assert rec.file_offset < at < rec.file_offset + rec.length
    flip_bit(path, at + 5, bit=3)
    report = verify_checkpoint(tmp_path / "c")
    [err] = _errors(report)
    assert err.check == "checksum"
    assert (err.file, err.item, err.offset, err.length) == (
        "__1_0.distcp",
        "layer.weight chunk (4, 0)",
        rec.file_offset,
        rec.length,
    )
    assert f"{rec.crc:#010x}" in err.message and "damaged" in err.message
    # Without checksums the flipped element decodes fine: only the checksum can see it.
    item = path.read_bytes()[rec.file_offset : rec.file_offset + rec.length]
    assert torch.load(io.BytesIO(item), weights_only=True).shape == (4, 6)


def test_truncated_data_file(tmp_path):
    make_checkpoint(tmp_path / "c")
    last = max(
        (r for r in records_from_index(read_index(tmp_path / "c")) if r.relative_path == "__0_0.distcp"),
        key=lambda r: r.file_offset,
    )
    path = tmp_path / "c" / "__0_0.distcp"
    os.truncate(path, path.stat().st_size - 10)
    report = verify_checkpoint(tmp_path / "c", deep=True)
    [err] = _errors(report)
    assert err.check == "range" and err.file == "__0_0.distcp" and err.item == "rng/shard_0_2"
    assert err.offset == last.file_offset and "truncated" in err.message
    assert f"[{last.file_offset}, {last.file_offset + last.length})" in err.message
    assert report.items_decoded == 5  # the other items were still checked


def test_missing_data_file(tmp_path):
    make_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "__1_0.distcp").unlink()
    report = verify_checkpoint(tmp_path / "c")
    [err] = _errors(report)
    assert err.check == "file" and err.file == "__1_0.distcp" and "missing" in err.message
    assert "3 items" in err.message
    assert report.items_checksummed == 3  # rank 0's items


def test_deleted_dcp_metadata(tmp_path):
    make_checkpoint(tmp_path / "c")
    (tmp_path / "c" / ".metadata").unlink()
    report = verify_checkpoint(tmp_path / "c")
    [err] = _errors(report)
    assert err.check == "metadata" and err.file == ".metadata" and "missing" in err.message


def test_undecodable_dcp_metadata(tmp_path):
    make_checkpoint(tmp_path / "c")
    path = tmp_path / "c" / ".metadata"
    path.write_bytes(path.read_bytes()[:40])
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "metadata" and "cannot be decoded" in err.message


def test_corrupted_common_pt(tmp_path):
    make_checkpoint(tmp_path / "c")
    path = tmp_path / "c" / "common.pt"
    flip_bit(path, path.stat().st_size // 2)
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "common" and err.file == "common.pt" and "CRC-32" in err.message
    path.unlink()
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "common" and "missing" in err.message


def _without_checksums(c) -> None:
    """As Megatron-Core and torch DCP write .metadata: no checksums of ckptd's."""
    md = pickle.loads((c / ".metadata").read_bytes())
    del md.ckptd_checksums
    (c / ".metadata").write_bytes(pickle.dumps(md))


def _flip_in_archive_data(path, start: int = 0) -> None:
    """Flip a bit of the first tensor's bytes in the torch.save archive at ``start`` of ``path``."""
    import zipfile

    data = path.read_bytes()
    (entry,) = [i for i in zipfile.ZipFile(io.BytesIO(data[start:])).infolist() if "/data/" in i.filename]
    header = start + entry.header_offset
    name_len, extra_len = (int.from_bytes(data[header + a : header + a + 2], "little") for a in (26, 28))
    flip_bit(path, header + 30 + name_len + extra_len + 2)


def test_a_damaged_common_pt_without_a_recorded_checksum_is_found_by_its_archive(tmp_path):
    # A flipped bit in a tensor of the common state (an fp16 loss scale) decoded, and verify
    # passed it.
    c = tmp_path / "c"
    ckptd.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", torch.ones(4)), "scale": torch.full((64,), 65536.0)}, c)
    _without_checksums(c)
    _flip_in_archive_data(c / "common.pt")
    assert torch.load(c / "common.pt")["scale"][0] != 65536.0  # it decodes, wrong
    for deep in (False, True):
        [err] = _errors(verify_checkpoint(c, deep=deep))
        assert err.check == "common" and "CRC-32" in err.message and "damaged" in err.message
    # A load raises instead of resuming with it.
    request = {"w": ckptd.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    for load in (ckptd.load_common_state_dict, lambda c: ckptd.load(request, c)):
        with pytest.raises(ckptd.CorruptCheckpointError, match=r"common.pt .*CRC-32.*common state is damaged"):
            load(c)


def test_a_damaged_object_without_a_recorded_checksum_is_refused_by_its_archive(tmp_path):
    c = tmp_path / "c"
    obj = ckptd.ShardedObject("o", torch.full((64,), 65536.0), (1,), (0,))
    ckptd.save({"o": obj}, c)
    _without_checksums(c)
    stored = read_index(c).objects["o/shard_0_1"]
    _flip_in_archive_data(c / stored.relative_path, stored.file_offset)
    with pytest.raises(ckptd.CorruptCheckpointError, match=r"the item is damaged"):
        ckptd.load({"o": ckptd.ShardedObject("o", None, (1,), (0,))}, c)
    [err] = _errors(verify_checkpoint(c, deep=True))
    assert "CRC-32" in err.message


def test_missing_commit_marker_of_a_ckptd_checkpoint(tmp_path):
    make_checkpoint(tmp_path / "c")
    (tmp_path / "c" / "metadata.json").unlink()
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "backend" and "metadata.json is missing" in err.message
    (tmp_path / "c" / "metadata.json").write_text('{"sharded_backend": "zarr", "sharded_backend_version": 1}')
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "backend" and "zarr" in err.message


def test_without_checksums_only_deep_sees_a_damaged_item(tmp_path):
    make_checkpoint(tmp_path / "c", checksums=False)
    rec = _record(tmp_path / "c", "layer.bias")
    flip_bit(tmp_path / "c" / rec.relative_path, rec.file_offset + 1)  # inside the zip header ("PK..")
    shallow = verify_checkpoint(tmp_path / "c")
    assert shallow.ok and shallow.items_without_checksum == 6
    [note] = [f for f in shallow.findings if f.severity == NOTE]
    assert "6 of 6 items have no recorded checksum" in note.message and "--deep" in note.message
    deep = verify_checkpoint(tmp_path / "c", deep=True)
    [err] = _errors(deep)
    assert err.check == "decode" and err.item == "layer.bias chunk (0,)" and err.offset == rec.file_offset


def test_coverage_gap_and_overlap_name_key_and_ranks(tmp_path):
    make_checkpoint(tmp_path / "c")
    records = records_from_index(read_index(tmp_path / "c"))
    gap = [r for r in records if not (r.fqn == "layer.weight" and r.offsets == (4, 0))]
    write_metadata(tmp_path / "c", build_metadata(gap), fsync=False)
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "coverage" and err.item == "layer.weight" and "cover 24 of 48" in err.message
    moved = [dataclasses.replace(r, offsets=(2, 0)) if r.offsets == (4, 0) else r for r in records]
    write_metadata(tmp_path / "c", build_metadata(moved), fsync=False)
    errs = _errors(verify_checkpoint(tmp_path / "c"))
    assert any(e.check == "coverage" and "rank 0" in e.message and "rank 1" in e.message for e in errs), errs


def test_items_sharing_bytes_and_paths_outside(tmp_path):
    make_checkpoint(tmp_path / "c")
    records = records_from_index(read_index(tmp_path / "c"))
    bias = next(r for r in records if r.fqn == "layer.bias")
    bad = [
        r.stored_at(r.relative_path, bias.file_offset + 8, r.length, r.crc) if r.fqn == "rng/shard_0_2" else r
        for r in records
    ]
    bad = [r.stored_at("../evil.distcp", 0, r.length, r.crc) if r.fqn == "embedding" else r for r in bad]
    write_metadata(tmp_path / "c", build_metadata(bad), fsync=False)
    errs = _errors(verify_checkpoint(tmp_path / "c"))
    checks = {(e.check, e.file) for e in errs}
    assert ("range", "__0_0.distcp") in checks  # rng shard overlaps layer.bias
    assert ("file", "../evil.distcp") in checks
    assert any(e.check == "checksum" and e.item == "rng/shard_0_2" for e in errs)


def test_plain_torch_dcp_checkpoint_is_sound_with_notes(tmp_path):
    ref = reference_tensors()
    dcp.save(ref, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    report = verify_checkpoint(tmp_path / "d", deep=True)
    assert report.ok, report.findings
    assert report.items_without_checksum == report.items == 3 and report.items_decoded == 3
    notes = [f.message for f in report.findings if f.severity == NOTE]
    assert any("plain torch DCP" in n for n in notes) and any("no recorded checksum" in n for n in notes)


def test_objects_needing_unsafe_pickle_are_warnings_not_damage(tmp_path):
    ns = argparse.Namespace(lr=0.1)
    sd = {
        "x": ckptd.ShardedTensor.from_rank_offsets("x", torch.ones(2)),
        "o": ckptd.ShardedObject("args", ns, (1,), (0,)),
        "args": ns,
    }
    ckptd.save(sd, tmp_path / "c", fsync=False)
    report = verify_checkpoint(tmp_path / "c", deep=True)
    assert report.ok
    warnings = {f.check for f in report.findings if f.severity == WARNING}
    assert warnings == {"decode", "common"}
    trusted = verify_checkpoint(tmp_path / "c", deep=True, allow_unsafe_pickle=True)
    assert trusted.ok and trusted.findings == [] and trusted.items_decoded == 2


def test_progress_sink_sees_every_byte(tmp_path):
    make_checkpoint(tmp_path / "c")

    class Sink:
        total = done = 0

        def set_total(self, n):
            self.total = n

        def advance(self, n):
            self.done += n

    sink = Sink()
    verify_checkpoint(tmp_path / "c", progress=sink)
    records = records_from_index(read_index(tmp_path / "c"))
    assert sink.total == sink.done == sum(r.length for r in records)
    assert all(r.kind != TENSOR or r.crc is not None for r in records)


def test_every_single_bit_flip_in_data_and_common_state_is_found(tmp_path):
    """Each byte of a data file belongs to exactly one checksummed item, and common.pt has its own
    CRC: a flipped bit anywhere in them is an error, wherever it lands (headers included)."""
    import random
    import shutil

    make_checkpoint(tmp_path / "c")
    rng = random.Random(6)
    targets = ["__0_0.distcp", "__1_0.distcp", "common.pt"]
    for trial in range(45):
        name = targets[trial % len(targets)]
        damaged = tmp_path / f"d{trial}"
        shutil.copytree(tmp_path / "c", damaged)
        offset = rng.randrange((damaged / name).stat().st_size)
        flip_bit(damaged / name, offset, bit=rng.randrange(8))
        errors = _errors(verify_checkpoint(damaged))
        assert errors, f"bit flip at {name}:{offset} went unnoticed"
        assert all(e.file == name and e.check in ("checksum", "common") for e in errors), errors
        shutil.rmtree(damaged)


def test_every_truncation_of_any_file_is_found(tmp_path):
    """Cutting any file of the checkpoint short, at any length, is an error."""
    import random
    import shutil

    make_checkpoint(tmp_path / "c")
    rng = random.Random(7)
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert set(names) >= {"metadata.json", ".metadata", "common.pt", "__0_0.distcp", "__1_0.distcp"}
    for trial in range(40):
        name = names[trial % len(names)]
        damaged = tmp_path / f"t{trial}"
        shutil.copytree(tmp_path / "c", damaged)
        size = (damaged / name).stat().st_size
        keep = rng.choice([0, size - 1, rng.randrange(size)])
        os.truncate(damaged / name, keep)
        assert _errors(verify_checkpoint(damaged)), f"{name} cut to {keep} of {size} bytes went unnoticed"
        shutil.rmtree(damaged)


def test_torch_save_archive_damage_is_named_with_and_without_recorded_zip_crcs():
    """The deep check of one item's archive: zip CRC-32s recorded (torch's default, as DCP and
    Megatron-Core write) or left 0 (ckptd's tensor items, whose bytes its own checksum covers)."""
    from torch.utils.serialization import config

    from ckptd.format.archive import torch_save_problem

    for crc in (True, False):
        before = config.save.compute_crc32
        config.save.compute_crc32 = crc
        try:
            buf = io.BytesIO()
            torch.save(torch.arange(1024, dtype=torch.float32), buf)
        finally:
            config.save.compute_crc32 = before
        data = buf.getvalue()
        assert torch_save_problem(data) is None
        start = data.index(torch.arange(1024, dtype=torch.float32).numpy().tobytes())
        flipped = bytearray(data)
        flipped[start + 100] ^= 1
        assert (torch_save_problem(bytes(flipped)) is None) is not crc  # only a recorded CRC sees it
        if crc:
            assert "does not match the CRC-32" in torch_save_problem(bytes(flipped))
        # The directory says the tensor's record is longer than what follows it in the item.
        at = data.index(b"PK\x01\x02")  # the central directory's first entry
        while data[at + 46 : at + 46 + len(b"archive/data/0")] != b"archive/data/0":
            at = data.index(b"PK\x01\x02", at + 4)
        longer = bytearray(data)
        longer[at + 20 : at + 28] = (len(data) * 2).to_bytes(4, "little") * 2  # compressed, uncompressed sizes
        assert "truncated" in torch_save_problem(bytes(longer))
        no_header = bytearray(data)
        no_header[0:4] = b"XXXX"
        assert "local header" in torch_save_problem(bytes(no_header))


def test_deep_decodes_each_byte_item_by_the_dialect_that_wrote_it(tmp_path):
    """ckptd's own DCP-style checkpoints hold values as torch DCP does (``torch.save(value)``), next
    to ShardedObjects (``torch.save([obj])``) in Megatron-style ones (issue 26 item 7): before,
    --deep called every value of a checkpoint with metadata.json DAMAGED ("does not hold a
    one-element list")."""
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7, "loss": 0.25, "name": "run"}
    ckptd.save(sd, tmp_path / "dcp_style")
    report = verify_checkpoint(tmp_path / "dcp_style", deep=True)
    assert report.status == "OK" and report.items_decoded == report.items, report.findings
    # A ShardedObject shard is still held to Megatron-Core's one-element list.
    path = tmp_path / "megatron_style"
    ckptd.save({"o": ckptd.ShardedObject("o", {"a": 1}, (1,), (0,)), "step": 1}, path, checksums=False)
    md = pickle.loads((path / ".metadata").read_bytes())
    (idx,) = [i for i in md.storage_data if i.fqn == "o/shard_0_1"]
    buf = io.BytesIO()
    torch.save({"a": 1}, buf)  # not wrapped in a list
    with open(path / md.storage_data[idx].relative_path, "ab") as f:
        md.storage_data[idx] = _StorageInfo(md.storage_data[idx].relative_path, f.tell(), len(buf.getvalue()))
        f.write(buf.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(md))
    report = verify_checkpoint(path, deep=True)
    assert report.status == "DAMAGED" and "one-element list" in report.errors[0].message, report.findings


def test_verify_names_the_damaged_blocks_and_a_damaged_block_table(tmp_path):
    """An item over one 4 MiB block: a flipped bit is reported with the blocks it is in; a block
    checksum in .metadata that disagrees with sound bytes is reported too (a load of part of the
    item would fail on it)."""
    from ckptd.format.dcp_metadata import CHECKSUMS_ATTR

    ckptd.save({"w": torch.randn(3 << 20)}, tmp_path / "c")  # 12 MiB: four blocks with the headers
    rec = _record(tmp_path / "c", "w")
    assert len(rec.block_crcs) == 16 and verify_checkpoint(tmp_path / "c").ok
    flip_bit(tmp_path / "c" / rec.relative_path, rec.file_offset + (9 << 20))
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert err.check == "checksum" and "the item is damaged (in the 4 MiB blocks [2])" in err.message
    flip_bit(tmp_path / "c" / rec.relative_path, rec.file_offset + (9 << 20))

    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    blocks = getattr(md, CHECKSUMS_ATTR)["blocks"]
    key = next(iter(blocks))
    blocks[key] = blocks[key][:4] + bytes(4) + blocks[key][8:]
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    [err] = _errors(verify_checkpoint(tmp_path / "c"))
    assert "not the block checksums [1] recorded in .metadata" in err.message


def test_a_short_read_does_not_misalign_the_blocks(tmp_path, monkeypatch):
    """A network filesystem may return fewer bytes than asked: the next block was already being
    read from the short offset, so every later block was misaligned and a sound item reported
    damaged."""
    ckptd.save({"w": torch.randn(9 << 20 >> 2)}, tmp_path / "c")  # 9 MiB: three blocks
    real, calls = os.pread, []

    def short_once(fd, n, offset):
        calls.append(n)
        return real(fd, n - 12345 if len(calls) == 1 and n > 1 << 20 else n, offset)

    monkeypatch.setattr(os, "pread", short_once)
    report = verify_checkpoint(tmp_path / "c")
    monkeypatch.undo()
    assert report.ok, report.findings
    assert len(calls) > 1 and calls[0] > 1 << 20


def test_verify_of_a_root_whose_checkpoint_went_away_meanwhile_does_not_say_ok(tmp_path):
    """The tracker's checkpoint was removed (retention, gc) between the scan and its verification:
    nothing was judged, and the root's report said OK (exit 0)."""
    import shutil

    from ckptd.catalog import scan_root
    from ckptd.verifyroot import verify_root
    from tests.checkpoints import make_root

    root = make_root(tmp_path / "run", [10], latest=10)
    cat = scan_root(root)
    shutil.rmtree(root / "iter_0000010")
    report = verify_root(cat)
    assert not report.reports and report.status == "UNVERIFIED" and not report.ok


def test_an_item_the_storage_fails_to_return_is_unreadable_not_damaged(tmp_path, monkeypatch):
    """A stale NFS file handle while reading an item: ``ckptd verify`` said DAMAGED (a load says
    StorageError for it, and never falls back past it: ckptd.format.reader.read_error)."""
    import errno

    make_checkpoint(tmp_path / "c")
    real = os.pread

    def stale(fd, n, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("__0_0.distcp"):
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", stale)
    report = verify_checkpoint(tmp_path / "c")
    monkeypatch.undo()
    assert report.status == "UNREADABLE" and not report.ok and not _errors(report), report.findings
    unreadable = [f for f in report.findings if f.severity == "unreadable"]
    assert unreadable and all(f.file == "__0_0.distcp" and "ESTALE" in f.message for f in unreadable), unreadable


@pytest.mark.parametrize("name", ["__0_0" + "x" * 300 + ".distcp", "__0_0.distcp/inside"])
def test_a_data_file_name_no_file_can_have_is_damage_not_a_storage_failure(tmp_path, name):
    """.metadata naming a data file too long for the filesystem, or one inside a file: opening it
    fails with ENAMETOOLONG or ENOTDIR, which was taken for the storage failing (UNREADABLE), so a
    resume stopped at it instead of falling back past a damaged checkpoint."""
    from ckptd.recovery import structural_problem

    ck = tmp_path / "ck"
    dcp.save({"w": torch.arange(10.0)}, checkpoint_id=str(ck), no_dist=True)
    md = pickle.loads((ck / ".metadata").read_bytes())
    for k, v in list(md.storage_data.items()):
        md.storage_data[k] = _StorageInfo(relative_path=name, offset=v.offset, length=v.length)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    report = verify_checkpoint(ck)
    assert report.status == "DAMAGED", [f.message for f in report.findings]
    assert structural_problem(ck) is not None


def test_two_items_at_one_place_of_a_file_are_damage_for_a_load_too(tmp_path):
    """b's storage entry moved onto a's (a flipped bit in its offset): a load read the place once,
    as a, whose checksum passed, and gave b a's values."""
    ck = tmp_path / "ck"
    ckptd.save({"a": torch.full((1000,), 1.0), "b": torch.full((1000,), 2.0)}, ck)
    md = pickle.loads((ck / ".metadata").read_bytes())
    at = {k.fqn: v for k, v in md.storage_data.items()}
    for k, v in list(md.storage_data.items()):
        if k.fqn == "b":
            md.storage_data[k] = dataclasses.replace(v, offset=at["a"].offset)
    (ck / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ckptd.CorruptCheckpointError, match="stored at the same place, byte"):
        ckptd.load({"a": torch.zeros(1000), "b": torch.zeros(1000)}, ck)
    assert verify_checkpoint(ck).status == "DAMAGED"
