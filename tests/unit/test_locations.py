"""What a root or checkpoint path names (ckptd.storage.url.parse_location): an ``s3://`` URL, a
local directory, or a refusal. A URL passed as a ``pathlib.Path`` lost a slash
(``Path("s3://ckpt/run1")`` is ``s3:/ckpt/run1``) and once became a local directory ``./s3:``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptd.storage.url import S3Location, UnsupportedLocationError, parse_location


@pytest.mark.parametrize(
    "where",
    [
        Path("s3://ckpt/run1"),
        Path("gs://bucket/run"),
        Path("file:///data/run"),
        Path("s3:"),
        "s3:/ckpt/run1",  # the str of such a Path
        "S3:/ckpt/run1",
        "c:/run",
        "svn+ssh:/host/run",
        "./c:/run",  # the same relative path: the Path it would be is refused wherever it is parsed again
    ],
)
def test_a_url_that_lost_a_slash_is_refused_not_made_a_local_directory(where):
    with pytest.raises(UnsupportedLocationError, match="lost a slash.*pass a URL as a str"):
        parse_location(where)


@pytest.mark.parametrize(
    ("where", "local"),
    [
        ("run1", Path("run1")),
        (Path("ckpt/s3:/run1"), Path("ckpt/s3:/run1")),  # a colon past the first component
        (Path("/data/s3:/run1"), Path("/data/s3:/run1")),  # absolute: the way to name such a directory
        (Path("run:1/x"), Path("run:1/x")),  # not a scheme and a colon alone
        ("3s:/run", Path("3s:/run")),  # a scheme begins with a letter
        (Path(":/run"), Path(":/run")),
        ("file:///data/run", Path("/data/run")),
    ],
)
def test_local_paths_stay_local(where, local):
    assert parse_location(where) == local


def test_an_s3_url_given_as_a_str_is_a_location():
    assert parse_location("s3://ckpt/run1") == S3Location(bucket="ckpt", prefix="run1")
