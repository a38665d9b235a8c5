"""ckptd.format.tensorzip writes tensor items byte for byte as torch.save does (every storable
dtype, shapes of every rank, empty and large dimensions, zip CRC-32s on and off), and torch.load,
ckptd's archive check and DCP read them."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from ckptd.format.archive import torch_save_problem
from ckptd.format.items import _zip_crc32_omitted
from ckptd.format.records import dtype_name, supported_dtypes
from ckptd.format.tensorzip import ITEMSIZE, STORAGE_TYPES, RawTensor, contiguous_stride, fits, write_raw_tensor

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (300,), (70000,), (2, 3, 4, 5), (1, 1, 1, 1, 2), (257, 3)]


def _torch_save(t: torch.Tensor, crc: bool) -> bytes:
    buf = io.BytesIO()
    with _zip_crc32_omitted(not crc):
        torch.save(t, buf)
    return buf.getvalue()


def _ours(t: torch.Tensor, crc: bool) -> bytes:
    buf = io.BytesIO()
    raw = RawTensor(dtype_name(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
    assert fits(raw)
    write_raw_tensor(buf, raw, zip_crc32=crc)
    return buf.getvalue()


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    return raw.view(dtype).reshape(shape)


def test_the_tables_cover_every_storable_dtype():
    names = {dtype_name(dt) for dt in supported_dtypes()}
    assert set(STORAGE_TYPES) == names and set(ITEMSIZE) == names
    assert all(ITEMSIZE[dtype_name(dt)] == dt.itemsize for dt in supported_dtypes())


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
def test_byte_for_byte_torch_save(dtype, crc):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: experimental
        for shape in SHAPES:
            t = _sample(dtype, shape)
            assert _ours(t, crc) == _torch_save(t, crc), (dtype, shape, crc)


def test_contiguous_strides_are_torchs():
    for shape in SHAPES:
        assert contiguous_stride(shape) == torch.empty(shape).stride(), shape


def test_torch_load_reads_it_and_the_archive_check_passes():
    t = _sample(torch.float32, (64, 33))
    data = _ours(t, False)
    assert torch_save_problem(data) is None
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True).view(torch.int32), t.view(torch.int32))
