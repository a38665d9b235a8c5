"""Object-store edge cases without a store (fakes of the client's calls): moving ``latest`` after
a failed read, and a store that does not page its listing of unfinished uploads."""

from __future__ import annotations

from typing import Any

import pytest

from ckptd.errors import StorageError
from ckptd.roots.s3_tracker import point_tracker
from ckptd.storage.s3client import ObjectInfo, S3Client
from ckptd.storage.url import S3Location


class TrackerStore:
    """``latest`` exists (ETag "e1"), but reading it fails once (a timeout)."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes, bool, str | None]] = []
        self.reads = 0

    def url(self, key: str) -> str:
        return f"s3://b/r/{key}"

    def get(self, key: str, max_nbytes: int, what: str = "object") -> Any:
        self.reads += 1
        raise StorageError("the store did not answer in time")

    def head(self, key: str) -> ObjectInfo | None:
        return ObjectInfo(key=key, size=13, etag="e1", last_modified_unix_s=1.0)

    def put(self, key: str, data: bytes, *, if_match: str | None = None, create_only: bool = False) -> None:
        self.puts.append((key, data, create_only, if_match))


def test_moving_latest_after_a_failed_read_still_compares_and_swaps():
    """A read of ``latest`` that failed for a passing reason made its move a PUT without any
    precondition: whatever another writer put there meanwhile was overwritten."""
    store = TrackerStore()
    point_tracker(store, S3Location(bucket="b", prefix="r"), "iter_0000100")  # type: ignore[arg-type]
    assert store.puts == [("latest", b"iter_0000100\n", False, "e1")]


def test_a_store_that_does_not_page_its_unfinished_uploads_is_an_error_not_a_loop(monkeypatch):
    class Boto:
        calls = 0

        def list_multipart_uploads(self, **kwargs: Any) -> dict:
            Boto.calls += 1
            assert Boto.calls < 5, "the listing went on with the same markers"
            return {"Uploads": [], "IsTruncated": True, "NextKeyMarker": "k", "NextUploadIdMarker": "u"}

    client = S3Client.__new__(S3Client)
    client.location = S3Location(bucket="b", prefix="r")
    monkeypatch.setattr(client, "_boto_client", lambda: Boto())
    with pytest.raises(StorageError, match="listed the same page of unfinished uploads again"):
        client.uploads("")


def test_the_prefetch_window_is_kept_in_work_linear_in_the_pieces(tmp_path):
    """Keeping the view's read-ahead window counted every piece fetched so far at each piece it
    started: quadratic (8,000 pieces, a 125 GiB checkpoint's, took 9 s of bookkeeping; a TiB's
    verify, minutes). The futures it asks are counted here, not timed."""
    from concurrent.futures import Future

    from ckptd.storage.s3view import PIECE_NBYTES, S3RangeSource, SparseObject

    asked = 0

    class Done(Future):  # type: ignore[type-arg]
        def done(self) -> bool:
            nonlocal asked
            asked += 1
            return True

    class Pool:  # every fetch ends at once
        def submit(self, *args: Any) -> Future:  # type: ignore[type-arg]
            f = Done()
            f.set_result(None)
            return f

        def shutdown(self, **kwargs: Any) -> None:
            pass

    pieces = 2000
    (tmp_path / "x").touch()
    source = S3RangeSource(None, {"x": SparseObject("x", pieces * PIECE_NBYTES, tmp_path / "x")})  # type: ignore[arg-type]
    source._pool.shutdown()
    source._pool = Pool()  # type: ignore[assignment]
    source.prefetch([("x", 0, pieces * PIECE_NBYTES)])
    assert len(source._pieces) == pieces and asked < 10 * pieces, asked


def test_a_profile_that_does_not_exist_is_a_clear_error(tmp_path, monkeypatch):
    """AWS_PROFILE naming no profile escaped as botocore's ProfileNotFound, from whichever call
    first read the configuration."""
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StorageError, match="AWS profile 'no-such-profile' cannot be used.*check AWS_PROFILE"):
        S3Client(S3Location(bucket="bucket", prefix="ckpt"))


def test_a_data_object_recorded_with_an_impossible_size_names_the_object(tmp_path):
    """A commit record giving a data object more bytes than a file can have raised the OS error
    of the view's temporary file, naming neither the object nor the checkpoint."""
    from ckptd.errors import CorruptCheckpointError
    from ckptd.storage.s3view import sparse_object

    location = S3Location(bucket="bucket", prefix="ckpt/iter_0000010")
    with pytest.raises(CorruptCheckpointError, match=r"s3://bucket/ckpt/iter_0000010: data object '__0_0.distcp'"):
        sparse_object(location, tmp_path, "__0_0.distcp", "__0_0.distcp", 1 << 62)


def test_etags_of_one_object_compare_equal_whatever_a_store_puts_around_them():
    from ckptd.storage.s3client import plain_etag

    assert plain_etag('"d41d8cd98f00b204e9800998ecf8427e-3"') == "d41d8cd98f00b204e9800998ecf8427e-3"
    assert plain_etag('W/"abc"') == plain_etag("abc") == plain_etag(' "abc" ') == "abc"
