"""Loads check the CRC-32Cs recorded at save time (issue 25 M5): bit rot is a CorruptCheckpointError
naming key, file and byte range, never values returned silently; resuming without a step falls
back to the newest intact checkpoint with a warning, every rank alike."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import CorruptCheckpointError, LoadStats, ShardedObject, ShardedTensor
from ckptd.client.resume import load_latest
from ckptd.format.dcp_metadata import read_index
from ckptd.format.rootlayout import step_dir_name
from ckptd.loading.execute import ExecOptions
from ckptd.loading.loader import LoadRequest, run_load
from tests.checkpoints import flip_bit, make_checkpoint, make_root, reference_tensors

ST = ShardedTensor


def request() -> dict:
    return {
        "w": ST.from_rank_offsets("layer.weight", torch.empty(8, 6)),
        "b": ST.from_rank_offsets("layer.bias", torch.empty(6)),
        "e": ST.from_rank_offsets("embedding", torch.empty(4, 4, dtype=torch.bfloat16)),
        "rng": ShardedObject("rng", None, (2,), (1,)),
    }


def chunk(path: Path, key: str, i: int = 0):
    return read_index(path).tensors[key].chunks[i]


def test_a_flipped_bit_in_a_tensor_item_fails_the_load_naming_key_file_and_bytes(tmp_path):
    make_checkpoint(tmp_path / "c")
    c = chunk(tmp_path / "c", "layer.weight", 1)
    flip_bit(tmp_path / "c" / c.relative_path, c.file_offset + c.length - 200)  # in the elements
    with pytest.raises(CorruptCheckpointError) as err:
        ckptd.load(request(), tmp_path / "c")  # before: loaded, with one value changed
    msg = str(err.value)
    assert "tensor 'layer.weight' chunk at offsets (4, 0)" in msg and c.relative_path in msg
    assert f"bytes [{c.file_offset}, {c.file_offset + c.length})" in msg and "CRC-32C" in msg


@pytest.mark.parametrize("what", ["object", "common"])
def test_a_flipped_bit_in_a_sharded_object_or_common_pt_fails_the_load(tmp_path, what):
    make_checkpoint(tmp_path / "c")
    if what == "object":
        o = read_index(tmp_path / "c").objects["rng/shard_1_2"]
        flip_bit(tmp_path / "c" / o.relative_path, o.file_offset + o.length // 2)
        match = r"ShardedObject 'rng/shard_1_2' \(bytes \["
    else:
        data = (tmp_path / "c" / "common.pt").read_bytes()
        flip_bit(tmp_path / "c" / "common.pt", data.index(b"test"))  # "test" -> "uest": still decodes
        match = r"common.pt \(\d+ bytes\) has CRC-32C"
    with pytest.raises(CorruptCheckpointError, match=match):
        ckptd.load(request(), tmp_path / "c")
    if what == "common":
        with pytest.raises(CorruptCheckpointError, match=match):
            ckptd.load_common_state_dict(tmp_path / "c")


def test_a_flipped_bit_in_a_dcp_value_fails_the_load(tmp_path):
    ckptd.save({"w": torch.arange(6.0), "step": 1234567, "opt": {"lr": 0.5}}, tmp_path / "d")
    o = read_index(tmp_path / "d").objects["step"]
    raw = (tmp_path / "d" / o.relative_path).read_bytes()[o.file_offset : o.file_offset + o.length]
    at = raw.index((1234567).to_bytes(4, "little"))
    flip_bit(tmp_path / "d" / o.relative_path, o.file_offset + at)  # decodes as another int
    req = {"w": torch.empty(6), "step": 0, "opt": {"lr": 0.0}}
    with pytest.raises(CorruptCheckpointError, match="the value 'step'"):
        ckptd.load(req, tmp_path / "d")


def test_what_a_partial_read_checks(tmp_path):
    """Whole items are checked whatever the path (straight into the tensor, a strided copy out of a
    mapping, or through pread); a part of an item of one checksum block (4 MiB) is checked by
    reading the item again whole."""
    big = torch.randn(1024, 256)  # 1 MiB
    small = torch.randn(64, 32)  # 8 KiB
    sd = {
        "big": ST.from_rank_offsets("big", big),
        "small": ST.from_rank_offsets("small", small),
        **{f"col{i}": ST.from_rank_offsets("cols", big[:, i * 128 : (i + 1) * 128].clone(), (1, i, 2)) for i in (0, 1)},
    }
    ckptd.save(sd, tmp_path / "c")
    stats = LoadStats()
    half = {
        "big": ST.from_rank_offsets("big", torch.empty(512, 256), (0, 0, 2)),
        "small": ST.from_rank_offsets("small", torch.empty(32, 32), (0, 1, 2)),
        "cols": ST.from_rank_offsets("cols", torch.empty(1024, 256)),  # both column chunks, strided
    }
    out = ckptd.load(half, tmp_path / "c", stats=stats)
    assert torch.equal(out["cols"], big) and torch.equal(out["small"], small[32:])
    assert (stats.items_verified, stats.items_unverified) == (4, 0)  # small, both column chunks, big's half
    c = chunk(tmp_path / "c", "big")
    flip_bit(tmp_path / "c" / c.relative_path, c.file_offset + c.length - 100)  # in the half NOT read
    with pytest.raises(CorruptCheckpointError, match="tensor 'big'"):  # before: loaded, unchecked
        ckptd.load({"big": half["big"]}, tmp_path / "c")

    c = chunk(tmp_path / "c", "small")
    flip_bit(tmp_path / "c" / c.relative_path, c.file_offset + c.length - 100)  # in the half NOT read
    with pytest.raises(CorruptCheckpointError, match="tensor 'small'"):
        ckptd.load({"small": half["small"]}, tmp_path / "c")
    c = chunk(tmp_path / "c", "cols", 1)
    flip_bit(tmp_path / "c" / c.relative_path, c.file_offset + c.length // 2)
    for mmap in (True, False):  # out of a read-only mapping, or pread into a scratch buffer
        req = LoadRequest({"cols": half["cols"]}, tmp_path / "c", options=ExecOptions(use_mmap=mmap))
        with pytest.raises(CorruptCheckpointError, match=r"tensor 'cols' chunk at offsets \(0, 128\)"):
            run_load(read_index(tmp_path / "c"), req)


def test_an_item_larger_than_a_checksum_block_is_checked_whole(tmp_path):
    w = torch.randn(9 << 20 >> 2)  # 9 MiB: three blocks, checksummed while the next is read
    ckptd.save({"w": ST.from_rank_offsets("w", w)}, tmp_path / "c")
    stats = LoadStats()
    out = ckptd.load({"w": ST.from_rank_offsets("w", torch.empty_like(w))}, tmp_path / "c", stats=stats)
    assert torch.equal(out["w"], w) and stats.items_verified == 1
    c = chunk(tmp_path / "c", "w")
    for at in (c.file_offset + 5, c.file_offset + (6 << 20), c.file_offset + c.length - 3):  # header, data, tail
        flip_bit(tmp_path / "c" / c.relative_path, at)
        with pytest.raises(CorruptCheckpointError, match="tensor 'w'"):
            ckptd.load({"w": ST.from_rank_offsets("w", torch.empty_like(w))}, tmp_path / "c")
        flip_bit(tmp_path / "c" / c.relative_path, at)
    ckptd.load({"w": ST.from_rank_offsets("w", torch.empty_like(w))}, tmp_path / "c")


def test_resuming_falls_back_to_the_last_committed_intact_checkpoint(tmp_path, caplog):
    """What Checkpointer.load() without step runs (ckptd.client.resume.load_latest): before, the
    damaged newest checkpoint was loaded silently."""
    root = make_root(tmp_path / "r", [1, 2, 3], latest=3)
    for step in (3, 2):  # bit rot in the two newest
        c = chunk(root / step_dir_name(step), "layer.weight", 0)
        flip_bit(root / step_dir_name(step) / c.relative_path, c.file_offset + c.length - 8)
    damaged: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        out = load_latest(root, request(), damaged, 0, {})
    assert out["iteration"] == 1 and torch.equal(out["w"], reference_tensors()["layer.weight"])
    assert sorted(damaged) == [step_dir_name(2), step_dir_name(3)]
    assert "iter_0000003 is damaged" in caplog.text and "falling back to the intact one committed last" in caplog.text
    assert "a load found damaged" in caplog.text  # the tracker is not followed, and it says why
    c = chunk(root / step_dir_name(1), "layer.weight", 0)
    flip_bit(root / step_dir_name(1) / c.relative_path, c.file_offset + c.length - 8)
    with pytest.raises(CorruptCheckpointError, match="no other committed checkpoint"):
        load_latest(root, request(), damaged, 0, {})


def _resume_rows(rank: int, world: int, root: str) -> tuple[int, bool]:
    """Each rank loads its half of the rows of layer.weight: only rank 1 reads the damaged chunk."""
    damaged: dict[str, str] = {}
    req = {"w": ST.from_rank_offsets("layer.weight", torch.empty(4, 6), (0, rank, world))}
    out = load_latest(Path(root), req, damaged, rank, {})
    rows = reference_tensors()["layer.weight"][rank * 4 : (rank + 1) * 4]
    return out["iteration"], torch.equal(out["w"], rows)


@pytest.mark.timeout(120)
def test_ranks_fall_back_together_when_only_one_reads_the_damage(tmp_path):
    from tools.harness.ranks import run_ranks

    root = make_root(tmp_path / "r", [1, 2], latest=2)
    c = chunk(root / step_dir_name(2), "layer.weight", 1)  # rows 4..8, which only rank 1 reads
    flip_bit(root / step_dir_name(2) / c.relative_path, c.file_offset + c.length - 8)
    # Before: rank 0 resumed step 2 and rank 1 step 2 with a damaged value (or step 1 on its own).
    assert run_ranks(_resume_rows, 2, str(root), timeout_s=100) == [(1, True), (1, True)]


def test_chunks_that_overlap_next_to_an_equal_gap_are_refused(tmp_path):
    """Two stored chunks of 'w' overlap by one row while another row is stored by none (a damaged
    ``.metadata``): the count of elements each request gets matched, so the load returned with the
    gap's row left as it was (load_plain_tensors: uninitialised memory)."""
    from dataclasses import replace

    from ckptd.format.dcp_metadata import records_from_index
    from ckptd.format.dcp_pickle import metadata_pickle

    ck = tmp_path / "ck"
    ckptd.save({"a": torch.zeros(2, 8) + 1, "b": torch.zeros(2, 8) + 2}, ck)
    index = read_index(ck)
    records = {r.fqn: r for r in records_from_index(index)}
    rows_0_1 = replace(records["a"], fqn="w", global_shape=(4, 8), offsets=(0, 0), path=("w",))
    rows_1_2 = replace(records["b"], fqn="w", global_shape=(4, 8), offsets=(1, 0), path=("w",))  # row 3: none
    others = [r for r in records_from_index(index) if r.kind != "tensor"]
    (ck / ".metadata").write_bytes(metadata_pickle([rows_0_1, rows_1_2, *others], str(ck), index.common_crc))
    overlap = r"tensor 'w': its stored chunks at offsets \(0, 0\) \(sizes \(2, 8\)\) and \(1, 0\) .* overlap"
    with pytest.raises(CorruptCheckpointError, match=overlap):
        ckptd.load({"w": torch.full((4, 8), -7.0)}, ck)
    with pytest.raises(CorruptCheckpointError, match=overlap):
        ckptd.load_plain_tensors(ck)


def _without_block_checksums(ck: Path) -> None:
    """Rewrite ``ck``'s checksum table as ckptd wrote it before block checksums."""
    import pickle

    from ckptd.format.dcp_metadata import CHECKSUMS_ATTR

    md = pickle.loads((ck / ".metadata").read_bytes())
    table = getattr(md, CHECKSUMS_ATTR)
    del table["block_nbytes"], table["blocks"]
    (ck / ".metadata").write_bytes(pickle.dumps(md))


def test_an_item_read_in_part_is_checked_with_verify_partial_and_by_a_resume(tmp_path):
    """A checkpoint without block checksums (older ckptd): a flipped bit in a 256 KiB item read in
    part by a load onto a finer layout was returned without a word; with ``verify_partial`` (which a
    resume sets) the rest of the item is read and the damage found, and a resume falls back to an
    intact step."""
    root = tmp_path / "root"
    for step, value in ((10, 1.0), (20, 2.0)):
        ckptd.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.full((1024, 64), value))}, root / step_dir_name(step)
        )
        _without_block_checksums(root / step_dir_name(step))
    (root / "latest").write_text(step_dir_name(20))
    damaged = root / step_dir_name(20)
    chunk = read_index(damaged).tensors["w"].chunks[0]
    flip_bit(damaged / chunk.relative_path, chunk.file_offset + chunk.length - 4096)  # in rows 512..1023

    def first_half() -> dict:  # rows 0..511: the half without the flipped bit
        return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(512, 64), (0, 0, 2))}

    stats = LoadStats()
    assert torch.equal(ckptd.load(first_half(), damaged, stats=stats)["w"], torch.full((512, 64), 2.0))
    assert stats.items_unverified == 1
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' chunk at offsets \(0, 0\)"):
        ckptd.load(first_half(), damaged, verify_partial=True)
    assert torch.equal(load_latest(root, first_half(), {}, 0, {})["w"], torch.full((512, 64), 1.0))


def test_a_part_of_a_large_item_is_checked_by_the_blocks_it_read(tmp_path):
    """A 12 MiB item (three 4 MiB checksum blocks) read in quarters: each load checks the blocks
    holding its rows, reading those again, not the whole item; damage in a block it did not read
    leaves its values (correct) loaded."""
    w = torch.randn(3 << 20).reshape(768, 4096)  # 12 MiB of float32, 16 KiB rows
    ckptd.save({"w": ST.from_rank_offsets("w", w)}, tmp_path / "c")
    c = chunk(tmp_path / "c", "w")
    assert len(c.block_crcs) == 4 * 4  # the item's headers make it a little over 12 MiB

    def quarter(i: int) -> dict:  # rows [192 i, 192 (i + 1)): 3 MiB
        return {"w": ST.from_rank_offsets("w", torch.empty(192, 4096), (0, i, 4))}

    stats = LoadStats()
    out = ckptd.load(quarter(0), tmp_path / "c", stats=stats)
    assert torch.equal(out["w"], w[:192]) and (stats.items_verified, stats.items_unverified) == (1, 0)
    assert stats.bytes_read < 3 * (3 << 20)  # its 3 MiB and block 0 again, not the 12 MiB item
    data = (tmp_path / "c" / c.relative_path).read_bytes()
    at = data.index(w[600, 2000:2004].numpy().tobytes())
    assert (at - c.file_offset) >> 22 == 2  # rows 512..767 start in block 2
    flip_bit(tmp_path / "c" / c.relative_path, at)
    assert torch.equal(ckptd.load(quarter(0), tmp_path / "c")["w"], w[:192])
    for i in (2, 3):  # rows 384.. and 576..: both touch block 2
        with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' chunk at offsets \(0, 0\) .*, block 2 \(bytes"):
            ckptd.load(quarter(i), tmp_path / "c")
    cols = {"w": ST.from_rank_offsets("w", torch.empty(768, 2048), (1, 1, 2))}  # strided: every block
    with pytest.raises(CorruptCheckpointError, match="block 2"):
        ckptd.load(cols, tmp_path / "c")
    _without_block_checksums(tmp_path / "c")  # as older ckptd wrote it: unchecked unless asked
    stats = LoadStats()
    ckptd.load(quarter(3), tmp_path / "c", stats=stats)
    assert stats.items_unverified == 1
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w' chunk at offsets \(0, 0\) \(bytes"):
        ckptd.load(quarter(0), tmp_path / "c", verify_partial=True)


@pytest.mark.parametrize("bad", ["short", "not_bytes", "huge_int", "no_block_size"])
def test_a_malformed_block_checksum_table_is_refused_before_anything_is_read(tmp_path, bad):
    import pickle

    from ckptd.format.dcp_metadata import CHECKSUMS_ATTR

    ckptd.save({"w": ST.from_rank_offsets("w", torch.randn(3 << 20))}, tmp_path / "c")
    md = pickle.loads((tmp_path / "c" / ".metadata").read_bytes())
    table = getattr(md, CHECKSUMS_ATTR)
    key = next(iter(table["blocks"]))
    if bad == "short":
        table["blocks"][key] = table["blocks"][key][:-4]
    elif bad == "not_bytes":
        table["blocks"][key] = list(table["blocks"][key])
    elif bad == "huge_int":
        table["blocks"][key] = 1 << 40  # bytes(1 << 40) would allocate a TiB
    else:
        del table["block_nbytes"]
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="checksum table"):
        read_index(tmp_path / "c")


def _rewrite_table(ckpt: Path, change) -> None:
    import pickle

    from ckptd.format.dcp_metadata import CHECKSUMS_ATTR

    md = pickle.loads((ckpt / ".metadata").read_bytes())  # ckptd's own intact file
    change(getattr(md, CHECKSUMS_ATTR), md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))


def test_a_flipped_key_in_the_checksum_table_never_leaves_its_item_unchecked(tmp_path):
    """The table's keys are written apart from the items they name: a flipped bit in one left that
    item looked up without a checksum, and loaded unchecked."""
    make_checkpoint(tmp_path / "c")
    ckptd.load(request(), tmp_path / "c")
    c = chunk(tmp_path / "c", "layer.weight", 1)
    flip_bit(tmp_path / "c" / c.relative_path, c.file_offset + c.length - 200)  # bit rot as well

    def move_key(table, md):
        key = next(k for k in table["items"] if k[0] == "layer.weight" and tuple(k[1]) == (4, 0))
        table["items"][(key[0], (6, 0))] = table["items"].pop(key)

    _rewrite_table(tmp_path / "c", move_key)
    with pytest.raises(
        CorruptCheckpointError,
        match=r"records 1 item\(s\) the checkpoint does not hold, first 'layer.weight' at offsets \(6, 0\)",
    ):
        ckptd.load(request(), tmp_path / "c")


def test_a_chunk_outside_its_tensor_is_damage_even_where_shapes_may_differ(tmp_path):
    """Chunks [0, 5) and [6, 11) of a tensor of shape (10,) cover 10 elements: with
    allow_shape_mismatch the load took that for complete, left element 5 zero and filled index 10
    from the chunk past the end."""
    ckptd.save({"w": ST.from_rank_offsets("w", torch.arange(10.0))}, tmp_path / "c")

    def split(table, md):
        import copy

        entry = md.state_dict_metadata["w"]
        ((index, info),) = [(k, v) for k, v in md.storage_data.items() if k.fqn == "w"]
        second = copy.deepcopy(entry.chunks[0])
        entry.chunks[0].sizes = torch.Size([5])
        second.offsets, second.sizes = torch.Size([6]), torch.Size([5])
        entry.chunks.append(second)
        md.storage_data[type(index)("w", torch.Size([6]), None)] = info
        table["items"].clear()
        table.get("blocks", {}).clear()

    _rewrite_table(tmp_path / "c", split)
    with pytest.raises(
        CorruptCheckpointError, match=r"tensor 'w' of shape \(10,\) has a chunk at \(6,\) of sizes \(5,\)"
    ):
        ckptd.load({"w": ST.from_rank_offsets("w", torch.zeros(11), allow_shape_mismatch=True)}, tmp_path / "c")


@pytest.mark.parametrize(
    "code, fstype",
    [("EIO", "local"), ("EBADE", "local"), ("EUCLEAN", "local"), ("EIO", "nfs4"), ("EIO", "fuse.gcsfuse")],
)
def test_a_read_error_names_the_item_and_only_a_local_disks_is_fallen_back_past(
    tmp_path, monkeypatch, caplog, code, fstype
):
    """An I/O error reading a data file was a bare OSError naming no file. On a local disk (a bad
    sector; btrfs's or ZFS's own checksum failing) it is damage, which a resume falls back past; on
    a network filesystem or a FUSE mount it is a StorageError that stops the resume (a server's
    fault there: falling back would resume an older step, and the next commit would leave the newer
    ones to retention)."""
    import errno

    import ckptd.format.reader as reader
    import ckptd.loading.execute as execute
    from ckptd.errors import StorageError

    root = make_root(tmp_path / "r", [1, 2], latest=2)
    bad = str(root / step_dir_name(2))
    real = {name: getattr(os, name) for name in ("pread", "preadv")}
    number = getattr(errno, code)

    def failing(name):
        def read(fd, *args):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(bad):
                raise OSError(number, os.strerror(number))
            return real[name](fd, *args)

        return read

    for name in real:
        monkeypatch.setattr(execute.os, name, failing(name))
    if fstype != "local":  # the checkpoint on such a mount
        monkeypatch.setattr(reader, "filesystem_type", lambda fd: fstype)
    error = CorruptCheckpointError if fstype == "local" else StorageError
    with pytest.raises(error, match=rf"tensor '.*' chunk at offsets .* of .*iter_0000002.*{code}"):
        ckptd.load(request(), root / step_dir_name(2))
    damaged: dict[str, str] = {}
    if fstype != "local":
        with pytest.raises(StorageError, match="load again once it is back"):
            load_latest(root, request(), damaged, 0, {})
        assert not damaged
        return
    with caplog.at_level(logging.WARNING, logger="ckptd"):
        out = load_latest(root, request(), damaged, 0, {})
    assert out["iteration"] == 1 and list(damaged) == [step_dir_name(2)]
