"""When a save is taken on its devices while the ring is still being pinned
(ckptd.staging.devsnap.device_snapshot_fits): a pure decision over bytes per device, tested here
without a GPU (device objects need none). The snapshot itself runs on a GPU:
tests/integration/test_cuda_staging.py."""

from __future__ import annotations

import pytest
import torch

from ckptd import CkptdConfig
from ckptd.errors import CkptdError
from ckptd.format.items import PlannedItem
from ckptd.staging.devsnap import HOST_COPY_MAX_NBYTES, device_snapshot_fits, tensor_nbytes_by_device

GPU0, GPU1, CPU = torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cpu")
GIB = 1 << 30


@pytest.mark.parametrize(
    "pinning,nbytes,free,fraction,expect",
    [
        (True, {GPU0: 4 * GIB}, {GPU0: 60 * GIB}, 0.25, True),  # the H100 loop: 3.6 GiB of 77 free
        (False, {GPU0: 4 * GIB}, {GPU0: 60 * GIB}, 0.25, False),  # pinned already: DMA in save()
        (True, {GPU0: 4 * GIB}, {GPU0: 60 * GIB}, 0.0, False),  # turned off
        (True, {GPU0: 16 * GIB}, {GPU0: 60 * GIB}, 0.25, False),  # over a quarter of what is free
        (True, {GPU0: 15 * GIB}, {GPU0: 60 * GIB}, 0.25, True),  # exactly a quarter
        (True, {CPU: 4 * GIB}, {}, 0.25, False),  # host tensors only: fork or copy as before
        (True, {GPU0: 1 * GIB, CPU: HOST_COPY_MAX_NBYTES}, {GPU0: 60 * GIB}, 0.25, True),  # step counters
        (True, {GPU0: 1 * GIB, CPU: HOST_COPY_MAX_NBYTES + 1}, {GPU0: 60 * GIB}, 0.25, False),  # host-heavy
        (True, {GPU0: 1 * GIB, GPU1: 8 * GIB}, {GPU0: 60 * GIB, GPU1: 20 * GIB}, 0.25, False),  # one device full
        (True, {GPU0: 1 * GIB}, {}, 0.25, False),  # free memory unknown: nothing fits
    ],
)
def test_device_snapshot_fits(pinning, nbytes, free, fraction, expect):
    assert device_snapshot_fits(pinning, nbytes, free, fraction) is expect


def test_bytes_by_device_count_tensors_only():
    items = [
        PlannedItem(record=None, payload=torch.zeros(10, dtype=torch.float32)),  # type: ignore[arg-type]
        PlannedItem(record=None, payload=torch.zeros(3, dtype=torch.bfloat16)),  # type: ignore[arg-type]
        PlannedItem(record=None, payload=b"object bytes"),  # type: ignore[arg-type]
    ]
    assert tensor_nbytes_by_device(items) == {CPU: 46}


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_the_fraction_is_checked(fraction):
    with pytest.raises(CkptdError, match="device_snapshot_fraction"):
        CkptdConfig(device_snapshot_fraction=fraction)
