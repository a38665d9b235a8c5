"""Reading a checkpoint's data objects from a real S3 server (SeaweedFS): every piece of an
object comes from one version of it."""

from __future__ import annotations

import pytest

from ckptd.errors import StorageError
from ckptd.storage import s3view
from ckptd.storage.s3client import S3Client
from ckptd.storage.s3view import S3RangeSource, sparse_object
from ckptd.storage.url import parse_location

PIECE = 4096


@pytest.fixture
def client(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> S3Client:
    monkeypatch.setattr(s3view, "PIECE_NBYTES", PIECE)  # three pieces of a 12 KiB object
    return S3Client(parse_location(f"s3://{s3_bucket}/ckpt"))


def _source(client: S3Client, tmp_path) -> S3RangeSource:
    obj = sparse_object(client.location, tmp_path, "__0_0.distcp", "__0_0.distcp", 3 * PIECE)
    return S3RangeSource(client, {"__0_0.distcp": obj})


def test_pieces_of_one_version_read_back_as_written(client, tmp_path):
    data = bytes(range(256)) * (3 * PIECE // 256)
    client.put("__0_0.distcp", data)
    source = _source(client, tmp_path)
    try:
        source.ensure("__0_0.distcp", 0, 3 * PIECE)
    finally:
        source.close()
    assert (tmp_path / "__0_0.distcp").read_bytes() == data


def test_an_object_replaced_between_its_pieces_is_an_error_not_a_mix(client, tmp_path):
    """A DCP checkpoint overwritten in place while it loads: the ranged reads took the first
    pieces from the old object and the rest from the new one, and the load got a mix of both."""
    client.put("__0_0.distcp", b"a" * (3 * PIECE))
    source = _source(client, tmp_path)
    try:
        source.ensure("__0_0.distcp", 0, PIECE)
        client.put("__0_0.distcp", b"b" * (3 * PIECE))
        with pytest.raises(StorageError, match="was replaced while it was read"):
            source.ensure("__0_0.distcp", PIECE, PIECE)
    finally:
        source.close()


def test_a_multipart_object_reads_back_piece_by_piece(client, tmp_path):
    """A data object is a multipart upload, whose ETag ("<md5>-<parts>") every ranged GET of it
    returns alike: its pieces pass the version check."""
    data = bytes(range(256)) * ((12 << 20) // 256)
    with client.writer("__0_0.distcp", 5 << 20, 2) as w:
        w.write(data)
    info = client.head("__0_0.distcp")
    assert info is not None and info.etag is not None and "-" in info.etag  # several parts
    obj = sparse_object(client.location, tmp_path, "__0_0.distcp", "__0_0.distcp", len(data))
    source = S3RangeSource(client, {"__0_0.distcp": obj})
    try:
        source.ensure("__0_0.distcp", 0, len(data))  # 3,072 pieces of 4 KiB
    finally:
        source.close()
    assert (tmp_path / "__0_0.distcp").read_bytes() == data
