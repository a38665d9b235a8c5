"""ckptd.format.dcp_pickle writes, without torch, the bytes pickle.dumps gives for DCP's Metadata.

The reference builds the Metadata from torch DCP's own classes (as ckptd did before the node
daemon stopped importing torch) and pickles it as DCP's FileSystemWriter does (``pickle.dump``,
the default protocol) and as ckptd's object-store roots do (the highest protocol).
"""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptd.format.checksum import ALGORITHM, BLOCK_NBYTES, TABLE_VERSION, block_count
from ckptd.format.dcp_metadata import build_metadata, read_index
from ckptd.format.dcp_pickle import CHECKSUMS_ATTR, DCP_VERSION, metadata_pickle
from ckptd.format.records import (
    _ITEMSIZE,
    BYTES,
    TENSOR,
    ItemRecord,
    dtype_from_name,
    storable_dtypes,
    supported_dtypes,
)


def _reference(records: list[ItemRecord], checkpoint_id: str | None, common_crc: int | None) -> Metadata:
    """The Metadata of ``records`` built from DCP's classes, sharing objects as ckptd always did."""
    state: dict = {}
    storage: dict = {}
    chunks: dict[str, list[ItemRecord]] = defaultdict(list)
    paths: dict[str, tuple] = {}
    shared: dict = {}
    sizes: dict = {}

    def size(shape: tuple[int, ...]) -> torch.Size:
        found = sizes.get(shape)
        if found is None:
            found = sizes[shape] = torch.Size(shape)
        return found

    for r in records:
        if r.path:
            paths[r.fqn] = tuple(r.path)
        if r.kind == TENSOR:
            chunks[shared.setdefault(r.fqn, r.fqn)].append(r)
        else:
            state[r.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(r.fqn)] = _StorageInfo(
                shared.setdefault(r.relative_path, r.relative_path), r.file_offset, r.length
            )
    for fqn, items in chunks.items():
        items.sort(key=lambda r: r.offsets)
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype_from_name(items[0].dtype)),
            size=torch.Size(items[0].global_shape),
            chunks=[ChunkStorageMetadata(torch.Size(r.offsets), size(r.sizes)) for r in items],
        )
        for i, r in enumerate(items):
            storage[MetadataIndex(fqn, r.offsets, i)] = _StorageInfo(
                shared.setdefault(r.relative_path, r.relative_path), r.file_offset, r.length
            )
    md = Metadata(
        state_dict_metadata=dict(sorted(state.items())),
        planner_data={fqn: paths.get(fqn, (fqn,)) for fqn in sorted(state)},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id),
        version=DCP_VERSION,
    )
    item_crcs = {
        (shared.setdefault(r.fqn, r.fqn), tuple(r.offsets) if r.kind == TENSOR else ()): r.crc
        for r in records
        if r.crc is not None
    }
    blocks = {
        (shared.setdefault(r.fqn, r.fqn), tuple(r.offsets)): r.block_crcs
        for r in records
        if r.block_crcs and r.crc is not None and r.kind == TENSOR
    }
    if item_crcs or common_crc is not None:
        files = {} if common_crc is None else {"common.pt": common_crc}
        table = {
            "version": TABLE_VERSION,
            "algorithm": ALGORITHM,
            "items": item_crcs,
            "files": files,
            "block_nbytes": BLOCK_NBYTES,
            "blocks": blocks,
        }
        setattr(md, CHECKSUMS_ATTR, table)
    return md


def _records(n: int, seed: int, ranks: int = 4) -> list[ItemRecord]:
    """``n`` keys of every storable dtype, 0-3 dimensions, split over ``ranks`` ranks, values and
    ShardedObject shards among them, large offsets and lengths, records in random order."""
    rng = random.Random(seed)
    names = [str(d).removeprefix("torch.") for d in supported_dtypes()]
    out = []
    for i in range(n):
        if rng.random() < 0.1:
            fqn = f"obj{i}/shard_0_1" if i % 2 else f"v{i}"
            crc = rng.randrange(2**32) if i % 3 else None
            length = rng.randint(1, 2**33)
            rel = f"__{i % ranks}_0.distcp"
            rec = ItemRecord(
                fqn=fqn, kind=BYTES, rank=i % ranks, relative_path=rel, file_offset=i * 10**6, length=length, crc=crc
            )
            out.append(rec)
            continue
        shape = tuple(rng.randint(1, 70000) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(names)
        for rk in range(ranks if shape else 1):
            offsets = ((rk * shape[0],) + (0,) * (len(shape) - 1)) if shape else ()
            global_shape = ((shape[0] * ranks,) + shape[1:]) if shape else ()
            length = rng.randint(1, 2**31)
            rec = ItemRecord(
                fqn=f"model.layers.{i}.ü.weight",
                kind=TENSOR,
                rank=rk,
                dtype=dtype,
                global_shape=global_shape,
                offsets=offsets,
                sizes=shape,
                relative_path=f"__{rk}_0.distcp",
                file_offset=rng.randint(0, 2**40),
                length=length,
                crc=rng.randrange(2**32),
                block_crcs=rng.randbytes(4 * block_count(length)) if i % 3 else b"",
                path=("model", "layers", i, "weight") if i % 2 else (),
            )
            out.append(rec)
    rng.shuffle(out)
    return out


def _w_chunk(**fields: Any) -> ItemRecord:
    """A chunk of the tensor "w" that rank 0 stored in the file "d"."""
    return ItemRecord(fqn="w", kind=TENSOR, rank=0, relative_path="d", **fields)


CASES = {
    "empty": ([], None, None),
    "one tensor, no checksums": (
        [_w_chunk(dtype="float32", global_shape=(2,), offsets=(0,), sizes=(2,), file_offset=0, length=8)],
        "/c",
        None,
    ),
    "one value": (
        [ItemRecord(fqn="v", kind=BYTES, rank=0, relative_path="__0_0.distcp", file_offset=0, length=9)],
        None,
        7,
    ),
    "small": (_records(12, 1), "/ckpt/iter_0000001", 12345),
    # 1,000 and 1,001 keys: the C pickler's batches of 1,000 (an empty batch after a multiple)
    "1000 values": (
        [
            ItemRecord(fqn=f"k{i:04}", kind=BYTES, rank=0, relative_path="d", file_offset=i, length=1)
            for i in range(1000)
        ],
        "/c",
        1,
    ),
    "1001 chunks": (
        [
            _w_chunk(dtype="int8", global_shape=(1001,), offsets=(i,), sizes=(1,), file_offset=i, length=1)
            for i in range(1001)
        ],
        "/",
        None,
    ),
    # many frames of 64 KiB; memo indices beyond 256 (LONG_BINGET)
    "3000 keys": (_records(3000, 2), "/ckpt/iter_0000002", 2**32 - 1),
    # 71,680 bytes of block checksums: a payload written between frames
    "a 70 GiB chunk": (
        [
            _w_chunk(
                dtype="uint8",
                global_shape=(70 << 30,),
                offsets=(0,),
                sizes=(70 << 30,),
                file_offset=0,
                length=(70 << 30) + 1000,
                crc=5,
                block_crcs=bytes(range(256)) * 280 + b"\x07" * 4,
            )
        ],
        "/c",
        None,
    ),
    "a 70,000-character id": (
        [_w_chunk(dtype="bool", global_shape=(1,), offsets=(0,), sizes=(1,), file_offset=0, length=1)],
        "x" * 70000,
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("protocol", [pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL])
def test_metadata_pickle_is_dcps_pickle(case, protocol):
    records, checkpoint_id, common_crc = CASES[case]
    expected = pickle.dumps(_reference(records, checkpoint_id, common_crc), protocol=protocol)
    assert metadata_pickle(records, checkpoint_id, common_crc, protocol=protocol) == expected


def test_build_metadata_and_read_index_see_the_same_checkpoint(tmp_path):
    records, checkpoint_id, common_crc = CASES["small"]
    # lengths that hold the chunks (read_index refuses a chunk larger than its item)
    records = [replace(r, length=max(r.length, r.nbytes + 64)) for r in records]
    records = [replace(r, block_crcs=bytes(4 * block_count(r.length))) if r.block_crcs else r for r in records]
    md = build_metadata(records, checkpoint_id, common_crc)
    ref = _reference(records, checkpoint_id, common_crc)
    assert md == ref and getattr(md, CHECKSUMS_ATTR) == getattr(ref, CHECKSUMS_ATTR)
    (tmp_path / ".metadata").write_bytes(metadata_pickle(records, checkpoint_id, common_crc))
    index = read_index(tmp_path)
    assert index.common_crc == common_crc
    assert set(index.tensors) | set(index.objects) == {r.fqn for r in records}
    blocks = {(t.fqn, c.offsets): c.block_crcs for t in index.tensors.values() for c in t.chunks}
    assert blocks == {(r.fqn, r.offsets): r.block_crcs for r in records if r.kind == TENSOR}
    assert any(blocks.values()) and index.block_nbytes == BLOCK_NBYTES


def test_the_static_dtype_table_is_torchs():
    """The node daemon sizes items from a table it has without torch; it must be the table ckptd
    derives from the installed torch (a new torch dtype: add it to records._ITEMSIZE)."""
    assert {name: d.itemsize for name, d in storable_dtypes().items()} == _ITEMSIZE


def test_the_daemons_modules_import_no_torch():
    """What a node daemon process imports to start, save and commit leaves torch out."""
    code = (
        "import sys\n"
        "import ckptd.commands, ckptd.commands.daemon, ckptd.daemon.main, ckptd.daemon.node\n"
        "import ckptd.format.finalize, ckptd.format.dcp_pickle, ckptd.roots.posix_root, ckptd.roots.s3_root\n"
        "import ckptd.daemon.mirror, ckptd.daemon.workers, ckptd.daemon.coordinator\n"
        # A record of a dtype the daemon does not know is refused without importing torch (it was
        # imported to look the name up: 220 MiB in the daemon, at a peer's word).
        "from ckptd.control.itemchecks import check_record\n"
        "from ckptd.format.records import ItemRecord\n"
        "try:\n"
        "    check_record(ItemRecord(fqn='w', kind='tensor', rank=0, dtype='float7_e9', global_shape=(1,),"
        " offsets=(0,), sizes=(1,)))\n"
        "except Exception as exc:\n"
        "    assert 'unknown dtype name' in str(exc), exc\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_a_dtype_newer_than_the_table_is_refused_where_the_rank_plans_its_save(tmp_path, monkeypatch):
    """A torch newer than this ckptd (a storable dtype its daemons do not know): refused by name at
    planning, on every process alike (the daemon refused it only until something imported torch);
    a checkpoint that holds it (another writer's) is read as any other."""
    import ckptd
    from ckptd.format import records
    from ckptd.recovery import structural_problem

    w = torch.tensor([0, 1, 2, 65535], dtype=torch.uint16)
    ckptd.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "old")
    monkeypatch.setattr(records, "_ITEMSIZE", {k: v for k, v in records._ITEMSIZE.items() if k != "uint16"})
    records._torch_dtypes.cache_clear()
    try:
        with pytest.raises(ckptd.ShardingError, match=r"dtype torch.uint16, which this ckptd does not know yet"):
            ckptd.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
        assert structural_problem(tmp_path / "old") is None  # never taken for damaged (a resume fell back past it)
        assert torch.equal(ckptd.load_plain_tensors(tmp_path / "old")["w"], w)
    finally:
        monkeypatch.undo()
        records._torch_dtypes.cache_clear()
