"""Block checksums (ckptd.format.checksum): CRC-32C combination and what the item writer records."""

from __future__ import annotations

import io
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptd.format.checksum import BLOCK_NBYTES, block_count, crc32c, crc32c_combine, unpack_blocks
from ckptd.format.items import ItemSink


@pytest.mark.parametrize("nbytes_b", [0, 1, 3, 4096, BLOCK_NBYTES - 1, BLOCK_NBYTES, BLOCK_NBYTES + 7])
def test_combining_two_crcs_is_the_crc_of_both(nbytes_b):
    a, b = os.urandom(1000), os.urandom(nbytes_b)
    assert crc32c_combine(crc32c(a), crc32c(b), nbytes_b) == crc32c(a + b)


@pytest.mark.parametrize("executor", [False, True])
@pytest.mark.parametrize("length", [0, 10, BLOCK_NBYTES, BLOCK_NBYTES + 1, 3 * BLOCK_NBYTES - 5])
def test_the_sink_records_each_blocks_crc_whatever_the_write_sizes(length, executor):
    """torch.save hands the sink headers, then storages in one write: any split must give the
    same block checksums as the bytes in the file, and the item's from them."""
    rng = random.Random(length)
    data = rng.randbytes(length)
    f = io.BytesIO()
    f.write(b"x" * 100)  # the item starts inside the file
    with ThreadPoolExecutor(1) as pool:
        sink = ItemSink(f, True, pool if executor else None)
        sink.begin()
        pos = 0
        while pos < length:
            n = rng.choice([1, 7, 4096, BLOCK_NBYTES // 3, BLOCK_NBYTES + 11])
            sink.write(data[pos : pos + n])
            pos += n
        start, n, crc, blocks = sink.end()
    assert (start, n, crc) == (100, length, crc32c(data))
    expected = [crc32c(data[i : i + BLOCK_NBYTES]) for i in range(0, length, BLOCK_NBYTES)]
    assert unpack_blocks(blocks) == (tuple(expected) if len(expected) > 1 else ())
    assert len(blocks) == 4 * block_count(length)
