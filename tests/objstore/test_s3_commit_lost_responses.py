"""S3Root.commit when a write reaches the store but its response does not reach the client (a
connection reset or a timeout on the last try, or obstore's retry of the applied request refused
by its own precondition): the commit must end as the store says, never with ``latest`` naming a
removed step nor with a commit object whose save was reported aborted.

The faults are injected into the root's S3Client against the session's real SeaweedFS server: the
request is performed, then the client raises what it would have raised."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import ckptd
from ckptd.errors import CheckpointExistsError, StorageError
from ckptd.format.checksum import crc32c
from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord
from ckptd.format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON
from ckptd.format.rootlayout import TRACKER_FILE
from ckptd.roots.base import CommitOutcome
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import read_s3_commit_record, read_s3_tracker
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import parse_location
from tests.objstore.commits import commit_one_rank

Put = Callable[..., str | None]


def _root(bucket: str) -> S3Root:
    return S3Root(parse_location(f"s3://{bucket}/run"))


def _attempt(step: int, n: int = 1) -> str:
    return f"0123456789ab-{step * 10 + n}"


def _coordinator_commit(root: S3Root, step: int, attempt: str) -> CommitOutcome:
    """root.commit as the coordinator's commit thread runs it: a failed commit is aborted."""
    try:
        return commit_one_rank(root, step, attempt)
    except BaseException:
        root.abort(step, attempt)
        raise


def _fault(
    monkeypatch: pytest.MonkeyPatch, client: S3Client, key: str, *, applied: bool = True, then: str = "lost"
) -> dict[str, int]:
    """The next PUT of ``key``: performed against the store when ``applied``, then failing as a
    lost response does: ``then="lost"`` raises the client's StorageError (the last try timed
    out), ``then="retry"`` performs the request again, which the store refuses by its precondition
    (obstore's retry of a request whose response was lost)."""
    real: Put = client.put
    hits = {"n": 0}

    def put(k: str, data: Any, **kw: Any) -> str | None:
        if k != key or hits["n"]:
            return real(k, data, **kw)
        hits["n"] += 1
        if applied:
            real(k, data, **kw)
        if then == "retry":
            return real(k, data, **kw)
        raise StorageError(
            f"could not write {client.url(k)}: RequestTimeout: injected: the response was lost; check the endpoint"
        )

    monkeypatch.setattr(client, "put", put)
    return hits


def _unreadable(monkeypatch: pytest.MonkeyPatch, client: S3Client, key: str, after: dict[str, int]) -> None:
    """Every GET of ``key`` fails once the fault ``after`` struck (the store unreachable now)."""
    real = client.get

    def get(k: str, *args: Any, **kw: Any) -> Any:
        if k == key and after["n"]:
            raise StorageError(f"could not read {client.url(k)}: injected: connection refused; check the endpoint")
        return real(k, *args, **kw)

    monkeypatch.setattr(client, "get", get)


def _committed_and_latest(root: S3Root, step: int, attempt: str) -> CommitRecord:
    name = f"iter_{step:07d}"
    cat = root.scan(usage=False)
    assert cat.tracker_problem is None
    latest = cat.latest()
    assert latest is not None and latest.name == name
    record = read_s3_commit_record(root.client, name)
    assert record is not None and record.attempt == attempt and record.step == step
    assert record.seq == max(e.commit_seq for e in cat.committed)
    assert record.objects is not None
    for obj in (COMMON_PT, DCP_METADATA, METADATA_JSON):  # what the record says is what is stored
        got = root.client.get(f"{name}/{obj}", 1 << 20)
        assert got is not None and crc32c(got[0]) == record.objects[obj]["crc32c"]
    loaded = ckptd.load_common_state_dict(root.display(name))
    assert loaded["iteration"] == step and loaded["v"] == f"value of step {step}"
    return record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", [True, False], ids=["create-latest", "move-latest"])
def test_a_tracker_update_the_store_applied_but_whose_response_was_lost_commits(s3_bucket, monkeypatch, first):
    """The store wrote ``latest`` but the client failed: the commit stands (before, its commit
    object was removed and the coordinator's abort emptied the step, leaving ``latest`` naming a
    step that no longer exists)."""
    root = _root(s3_bucket)
    if not first:
        _coordinator_commit(root, 10, _attempt(10))
    hits = _fault(monkeypatch, root.client, TRACKER_FILE)
    outcome = _coordinator_commit(root, 20, _attempt(20))
    assert hits["n"] == 1 and outcome.name == "iter_0000020"
    _committed_and_latest(root, 20, _attempt(20))
    assert root.recover(nnodes=1).finished is None  # nothing left to repair
    _coordinator_commit(root, 30, _attempt(30))  # and the root goes on
    _committed_and_latest(root, 30, _attempt(30))


@pytest.mark.timeout(120)
def test_a_tracker_update_the_store_did_not_apply_takes_the_commit_back(s3_bucket, monkeypatch):
    root = _root(s3_bucket)
    _coordinator_commit(root, 10, _attempt(10))
    _fault(monkeypatch, root.client, TRACKER_FILE, applied=False)
    with pytest.raises(StorageError, match="injected"):
        _coordinator_commit(root, 20, _attempt(20))
    assert read_s3_tracker(root.client)[1] == "iter_0000010"
    assert read_s3_commit_record(root.client, "iter_0000020") is None
    assert not list(root.client.list_objects("iter_0000020"))  # the abort removed the attempt
    _coordinator_commit(root, 20, _attempt(20, 2))  # a retry of the step commits
    _committed_and_latest(root, 20, _attempt(20, 2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("applied", [True, False], ids=["applied", "not-applied"])
def test_a_commit_is_kept_when_the_failed_tracker_cannot_be_read_back(s3_bucket, monkeypatch, applied):
    """Whether ``latest`` names the step is unknown: the commit object stays (removing it could
    leave the tracker naming a removed step), the save fails saying so, and the next
    coordinator start names the step latest."""
    root = _root(s3_bucket)
    _coordinator_commit(root, 10, _attempt(10))
    hits = _fault(monkeypatch, root.client, TRACKER_FILE, applied=applied)
    _unreadable(monkeypatch, root.client, TRACKER_FILE, hits)
    with pytest.raises(StorageError, match="whether iter_0000020 is latest is unknown") as failed:
        _coordinator_commit(root, 20, _attempt(20))
    assert "next coordinator start names it latest" in str(failed.value)
    root = _root(s3_bucket)  # a client without the faults: the store answers again
    record = read_s3_commit_record(root.client, "iter_0000020")
    assert record is not None and record.attempt == _attempt(20)
    assert read_s3_tracker(root.client)[1] == ("iter_0000020" if applied else "iter_0000010")
    assert root.recover(nnodes=1).finished == (None if applied else "iter_0000020")
    _committed_and_latest(root, 20, _attempt(20))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["retry", "lost"])
@pytest.mark.parametrize("obj", [COMMON_PT, DCP_METADATA, METADATA_JSON, COMMIT_RECORD])
def test_a_create_only_write_the_store_applied_but_whose_response_was_lost_commits(s3_bucket, monkeypatch, obj, then):
    """Before, a lost response of the commit object (obstore's retry then refused: 412) failed
    the save as "committed by someone else" though the object was this attempt's: the ranks were
    told it aborted, the abort kept it, and the next coordinator made it latest; one of a
    metadata object failed the save for nothing."""
    root = _root(s3_bucket)
    _coordinator_commit(root, 10, _attempt(10))
    hits = _fault(monkeypatch, root.client, f"iter_0000020/{obj}", then=then)
    _coordinator_commit(root, 20, _attempt(20))
    assert hits["n"] == 1
    _committed_and_latest(root, 20, _attempt(20))


@pytest.mark.timeout(120)
def test_a_commit_object_of_another_attempt_still_fails_the_commit(s3_bucket, monkeypatch):
    """Read back, a commit object that is not byte for byte this attempt's is another writer's."""
    root = _root(s3_bucket)
    _coordinator_commit(root, 10, _attempt(10))
    key, other = f"iter_0000020/{COMMIT_RECORD}", _attempt(20, 9)
    real: Put = root.client.put

    def put(k: str, data: Any, **kw: Any) -> str | None:
        if k == key:  # another coordinator's commit object lands first
            theirs = CommitRecord(seq=2, step=20, attempt=other, committed_unix_s=0.0, objects={})
            real(k, theirs.to_bytes(), create_only=True)
        return real(k, data, **kw)

    monkeypatch.setattr(root.client, "put", put)
    with pytest.raises(CheckpointExistsError, match="committed by someone else meanwhile"):
        _coordinator_commit(root, 20, _attempt(20))
    record = read_s3_commit_record(root.client, "iter_0000020")
    assert record is not None and record.attempt == other
    assert read_s3_tracker(root.client)[1] == "iter_0000010"


@pytest.mark.timeout(120)
def test_a_create_only_write_that_cannot_be_read_back_fails_saying_so(s3_bucket, monkeypatch):
    root = _root(s3_bucket)
    key = f"iter_0000020/{COMMIT_RECORD}"
    hits = _fault(monkeypatch, root.client, key)
    _unreadable(monkeypatch, root.client, key, hits)
    with pytest.raises(StorageError, match="whether the store wrote it is unknown") as failed:
        commit_one_rank(root, 20, _attempt(20))
    assert root.client.url(key) in str(failed.value) and "next coordinator start" in str(failed.value)
    root = _root(s3_bucket)  # a client without the faults: the store answers again
    root.abort(20, _attempt(20))  # the coordinator's abort: the commit object is this attempt's
    assert root.recover(nnodes=1).finished == "iter_0000020"
    _committed_and_latest(root, 20, _attempt(20))


@pytest.mark.timeout(120)
def test_a_commit_object_the_store_applies_after_the_abort_finds_its_checkpoint_whole(s3_bucket, monkeypatch):
    """The commit object's write timed out on every try, and reading it back found nothing yet:
    the store still held the request. The abort removed the attempt's objects; the store then
    applied the write, and the next coordinator start named a step without its objects latest."""
    root = _root(s3_bucket)
    _coordinator_commit(root, 10, _attempt(10))
    key = f"iter_0000020/{COMMIT_RECORD}"
    _fault(monkeypatch, root.client, key, applied=False)
    late = {}
    create = root.client.create

    def held(k: str, data: bytes, **kw: Any) -> None:
        if k == key:
            late["record"] = data  # the request the store holds
        create(k, data, **kw)

    monkeypatch.setattr(root.client, "create", held)
    with pytest.raises(StorageError, match="injected"):
        _coordinator_commit(root, 20, _attempt(20))
    assert read_s3_commit_record(root.client, "iter_0000020") is None
    root = _root(s3_bucket)  # the store applies the held write
    root.client.put(key, late["record"], create_only=True)
    assert root.recover(nnodes=1).finished == "iter_0000020"
    _committed_and_latest(root, 20, _attempt(20))


@contextlib.contextmanager
def _synchronous_saves_lose_the_answer_to(monkeypatch: pytest.MonkeyPatch, key: str) -> Iterator[None]:
    """While in the block, each ckptd.save to S3 has its write of ``key`` applied by the store, its
    answer lost, and obstore's retry refused by the precondition."""
    from ckptd.s3save import S3SaveTarget

    init = S3SaveTarget.__init__

    def faulty(self: S3SaveTarget, location: Any) -> None:
        init(self, location)
        _fault(monkeypatch, self.client, key, then="retry")

    monkeypatch.setattr(S3SaveTarget, "__init__", faulty)
    try:
        yield
    finally:
        monkeypatch.setattr(S3SaveTarget, "__init__", init)


@pytest.mark.timeout(60)
def test_a_synchronous_save_whose_metadata_json_write_lost_its_response_succeeds(s3_bucket, monkeypatch):
    """ckptd.save to S3: the store wrote ``metadata.json``, the client timed out. The save reported
    "Nothing was committed" for a complete checkpoint (and its retry, by the precondition, said
    another save had written the prefix)."""
    url = f"s3://{s3_bucket}/sync-lost/ckpt"
    with _synchronous_saves_lose_the_answer_to(monkeypatch, METADATA_JSON):
        ckptd.save({"w": torch.arange(8.0)}, parse_location(url))
    assert torch.equal(ckptd.load({"w": torch.zeros(8)}, parse_location(url))["w"], torch.arange(8.0))


@pytest.mark.timeout(60)
def test_a_synchronous_save_that_loses_the_race_leaves_the_winners_metadata(s3_bucket, monkeypatch):
    """Two ckptd.save to one prefix: the one whose common.pt create finds the other's there fails,
    and its clean-up removed the other's common.pt and .metadata, so the winner, reporting success,
    wrote a checkpoint that could not be loaded."""
    from ckptd.s3save import S3SaveTarget

    url = f"s3://{s3_bucket}/sync-race/ckpt"
    finalize = S3SaveTarget.finalize
    winner: dict[str, bytes] = {}

    def the_other_save_first(self: S3SaveTarget, records: Any, common: bytes) -> None:
        monkeypatch.setattr(S3SaveTarget, "finalize", finalize)
        ckptd.save({"w": torch.full((8,), 7.0)}, parse_location(url))  # checks, uploads, finalizes first
        winner.update({n: self.client.get(n, 1 << 20)[0] for n in (COMMON_PT, DCP_METADATA, METADATA_JSON)})
        finalize(self, records, common)

    monkeypatch.setattr(S3SaveTarget, "finalize", the_other_save_first)
    with pytest.raises(CheckpointExistsError, match="written by another save meanwhile"):
        ckptd.save({"w": torch.full((8,), 1.0)}, parse_location(url))
    client = S3Client(parse_location(url))
    assert {n: client.get(n, 1 << 20)[0] for n in winner} == winner
    assert torch.equal(ckptd.load({"w": torch.zeros(8)}, parse_location(url))["w"], torch.full((8,), 7.0))
    assert len([i for i in client.list_objects("") if i.key.endswith(".distcp")]) == 1  # the loser's removed


@pytest.mark.timeout(60)
def test_a_synchronous_save_whose_common_pt_lost_its_response_says_what_to_do(s3_bucket, monkeypatch):
    """The store wrote ``common.pt`` but the answer was lost: the save fails (two saves' common.pt
    can be equal byte for byte, so it is not read back), and so does a retry, saying the prefix
    holds a common.pt without a checkpoint and what to do."""
    url = f"s3://{s3_bucket}/sync-common/ckpt"
    with (
        _synchronous_saves_lose_the_answer_to(monkeypatch, COMMON_PT),
        pytest.raises(CheckpointExistsError, match="holds a common.pt but no checkpoint"),
    ):
        ckptd.save({"w": torch.arange(8.0)}, parse_location(url))
    with pytest.raises(CheckpointExistsError, match=r"If no save runs, delete s3://.*/sync-common/ckpt/common.pt"):
        ckptd.save({"w": torch.arange(8.0)}, parse_location(url))
    S3Client(parse_location(url)).delete([COMMON_PT])
    ckptd.save({"w": torch.arange(8.0)}, parse_location(url))
    assert torch.equal(ckptd.load({"w": torch.zeros(8)}, parse_location(url))["w"], torch.arange(8.0))


@pytest.mark.timeout(120)
def test_a_damaged_commit_object_of_the_latest_step_keeps_it_latest(s3_bucket):
    """The tracked step's commit object rots: its place in commit order is unknown. A coordinator
    start took it for the oldest commit and named the step before it latest (as if a crash had
    interrupted that one's commit); the rotten step then stood on an "abandoned branch"."""
    root = _root(s3_bucket)
    _coordinator_commit(root, 10, _attempt(10))
    _coordinator_commit(root, 20, _attempt(20))
    root.client.put(f"iter_0000020/{COMMIT_RECORD}", b'{"seq": 2, "st\xffep')
    assert root.recover(nnodes=1).finished is None
    assert read_s3_tracker(root.client)[1] == "iter_0000020"
    cat = root.scan(usage=False)
    assert cat.abandoned(20) is None and "is damaged" in (cat.latest().record_problem or "")
