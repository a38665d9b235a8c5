"""How large an upload's parts are (ckptd.storage.objwriter.part_nbytes_for): S3 takes at most
10,000 parts, so 32 MiB parts held at most 312.5 GiB, and a larger object failed at part 10,001,
after 312.5 GiB were uploaded, with an error that read like the network's. The part size grows
with the object's size, which the writer bounds before it uploads (data_file_max_nbytes)."""

from __future__ import annotations

import pytest
import torch

from ckptd.errors import StorageError
from ckptd.format.items import PlannedItem, data_file_max_nbytes, write_data_file
from ckptd.format.records import BYTES, TENSOR, ItemRecord
from ckptd.format.tensorzip import RawTensor
from ckptd.storage.objwriter import MAX_PART_NBYTES, MAX_PARTS, PART_NBYTES, part_nbytes_for

MIB = 1 << 20
GIB = 1 << 30
URL = "s3://b/r/iter_0000001/__0_0.x.distcp"


def test_parts_grow_only_for_an_object_their_limit_cannot_hold():
    assert part_nbytes_for(None, URL) == PART_NBYTES  # the size not known: the guard of the writer stays
    assert part_nbytes_for(0, URL) == PART_NBYTES
    assert part_nbytes_for(MAX_PARTS * PART_NBYTES, URL) == PART_NBYTES  # 312.5 GiB: 10,000 parts exactly
    assert part_nbytes_for(MAX_PARTS * PART_NBYTES + 1, URL) == PART_NBYTES + MIB
    assert part_nbytes_for(400 * GIB, URL) == 41 * MIB  # 40.96 MiB, a whole number of MiB
    assert part_nbytes_for(6 * MIB, URL, base_nbytes=MIB, max_parts=4) == 2 * MIB


@pytest.mark.parametrize(
    "nbytes", [313 * GIB, 1 << 40, 5 * (1 << 40), 7 * (1 << 40) + 12345, MAX_PARTS * MAX_PART_NBYTES]
)
def test_an_object_of_any_size_a_multipart_upload_holds_fits_its_part_limit(nbytes):
    part = part_nbytes_for(nbytes, URL)
    assert part % MIB == 0 and PART_NBYTES <= part <= MAX_PART_NBYTES
    assert -(-nbytes // part) <= MAX_PARTS


def test_an_object_no_multipart_upload_holds_is_refused_before_anything_is_uploaded():
    with pytest.raises(StorageError, match=r"__0_0\.x\.distcp.*10000 parts.*nothing was uploaded"):
        part_nbytes_for(MAX_PARTS * MAX_PART_NBYTES + 1, URL)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_the_bound_of_a_data_file_holds_what_is_written(tmp_path):
    """The parts are sized from the bound: a data file larger than it could outgrow its parts."""

    def tensor(name: str, t: torch.Tensor) -> PlannedItem:
        shape = tuple(t.shape)
        rec = ItemRecord(fqn=name, kind=TENSOR, rank=0, dtype="float32", global_shape=shape, offsets=(0,) * len(shape))
        return PlannedItem(rec, t)

    quantized = torch.quantize_per_channel(
        torch.randn(3, 200), torch.rand(200) + 0.1, torch.zeros(200, dtype=torch.long), 1, torch.qint8
    )
    raw = bytearray(4 * 1000)
    items = [
        tensor("deep", torch.zeros((1,) * 64)),
        tensor("plain", torch.randn(100, 7)),
        tensor("empty", torch.zeros(0, 5)),
        tensor("quantized", quantized),
        PlannedItem(ItemRecord(fqn="o", kind=BYTES, rank=0), b"x" * 1000),
        PlannedItem(
            ItemRecord(fqn="r", kind=TENSOR, rank=0, dtype="float32", global_shape=(1000,), offsets=(0,)),
            RawTensor("float32", (1000,), memoryview(raw)),  # type: ignore[arg-type]
        ),
    ]
    write_data_file(tmp_path, "d.distcp", items, fsync=False)
    written = (tmp_path / "d.distcp").stat().st_size
    assert written <= data_file_max_nbytes(items) <= written + len(items) * (16 << 10)
