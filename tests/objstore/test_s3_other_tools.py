"""Checkpoints another tool wrote into an ``s3://`` root (``ckptd.save``, torch DCP): a step with
metadata but no ``ckptd_commit.json``. A Checkpointer's start never removes one (it removed every
uncommitted step's objects, and with several nodes adopted ``ckptd.save``'s data object as an
attempt, whose abort removed the metadata), and a Checkpointer's save of that step fails instead
of replacing its metadata; a crashed Checkpointer attempt's leftovers are still removed or replaced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import CheckpointExistsError, SaveFailedError
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import read_s3_commit_record
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location, parse_location
from tests.objstore.commits import commit_one_rank
from tests.objstore.test_s3_roots import _config, _sd
from tools.harness.daemons import stop_root_daemons

CRASHED = "0123456789ab-1"  # a Checkpointer's attempt id


def _root(bucket: str) -> S3Location:
    loc = parse_location(f"s3://{bucket}/run")
    assert isinstance(loc, S3Location)
    return loc


def _objects(client: S3Client, step_name: str) -> dict[str, str | None]:
    """Every object of a step, with its ETag (an object written again has another)."""
    return {i.key: i.etag for i in client.list_objects(step_name)}


def _put_dcp_checkpoint(client: S3Client, step_name: str, state: dict, tmp_path: Path) -> None:
    """A torch DCP checkpoint, saved to a directory and uploaded under its own names."""
    import torch.distributed.checkpoint as dcp

    local = tmp_path / step_name
    dcp.save(state, checkpoint_id=str(local), no_dist=True)
    for f in sorted(local.iterdir()):
        client.put(f"{step_name}/{f.name}", f.read_bytes())


def _crashed_commit(client: S3Client, step_name: str) -> None:
    """What a Checkpointer's commit that died before its commit object leaves: its attempt's data
    object and the metadata objects written before."""
    client.put(f"{step_name}/__0_0.{CRASHED}.distcp", b"x" * 100)
    client.put(f"{step_name}/.metadata", b"a crashed commit's")
    client.put(f"{step_name}/common.pt", b"a crashed commit's")


@pytest.mark.timeout(180)
def test_a_checkpointer_start_keeps_the_checkpoints_other_tools_wrote_into_the_root(s3_bucket, runtime_dir, tmp_path):
    loc = _root(s3_bucket)
    root = str(loc)
    client = S3Client(loc)
    ckptd.save({"w": torch.arange(8.0)}, loc.child("iter_0000010"))
    _put_dcp_checkpoint(client, "iter_0000020", {"v": torch.arange(4.0)}, tmp_path)
    _crashed_commit(client, "iter_0000005")
    theirs = {name: _objects(client, name) for name in ("iter_0000010", "iter_0000020")}
    assert all(len(objs) >= 2 for objs in theirs.values())
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:  # its coordinator's start recovers
            assert ckpt.latest() is None  # neither is a commit of ckptd's
            assert {name: _objects(client, name) for name in theirs} == theirs
            assert not _objects(client, "iter_0000005")  # the crashed attempt's leftovers are removed
            ckpt.save(_sd(torch.full((64,), 30.0), 30), step=30).wait(timeout_s=60)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    assert {name: _objects(client, name) for name in theirs} == theirs
    assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000010")["w"], torch.arange(8.0))
    assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000020")["v"], torch.arange(4.0))


def test_recovery_names_what_it_keeps_and_several_nodes_adopt_only_attempts(s3_bucket, single_process):
    """With several nodes a start adopts the attempts it finds (another node may be writing them),
    and the coordinator aborts them later: ``ckptd.save``'s data object
    (``__0_0.<12 hex>.distcp``) is no attempt, and an adopted attempt's abort at a step holding
    another tool's checkpoint removes the attempt's objects only."""
    loc = _root(s3_bucket)
    client = S3Client(loc)
    ckptd.save({"w": torch.arange(8.0)}, loc.child("iter_0000010"))
    ckptd.save({"w": torch.arange(8.0)}, loc.child("iter_0000011"))
    client.put(f"iter_0000011/__1_0.{CRASHED}.distcp", b"x" * 100)  # a save of the step, refused or crashed
    client.put("iter_0000012/.metadata", b"metadata and nothing else")
    theirs = {name: _objects(client, name) for name in ("iter_0000010", "iter_0000011", "iter_0000012")}
    recovered = S3Root(loc).recover(nnodes=2)
    assert recovered.adopted == [(11, CRASHED)]
    assert [why.split(" ")[0] for why in recovered.kept] == [loc.url(n) for n in theirs]
    assert "another tool's checkpoint" in recovered.kept[0] and "__0_0." in recovered.kept[0]
    assert "remove it by hand" in recovered.kept[0]
    S3Root(loc).abort(11, CRASHED)  # what the coordinator does commit_timeout_s later
    assert {name: _objects(client, name) for name in theirs} == {
        **theirs,
        "iter_0000011": {k: v for k, v in theirs["iter_0000011"].items() if CRASHED not in k},
    }
    # One node: nothing can be in flight; still only what a Checkpointer's save names so goes.
    _crashed_commit(client, "iter_0000005")
    client.put(f"iter_0000011/__1_0.{CRASHED}.distcp", b"x" * 100)
    recovered = S3Root(loc).recover(nnodes=1)
    assert recovered.removed == [loc.url("iter_0000005"), f"the attempts' objects of {loc.url('iter_0000011')}"]
    assert len(recovered.kept) == 3
    assert not _objects(client, "iter_0000005")
    assert {name: _objects(client, name) for name in theirs} == {
        **theirs,
        "iter_0000011": {k: v for k, v in theirs["iter_0000011"].items() if CRASHED not in k},
    }
    # A ckptd.save caught between its common.pt and its .metadata (it writes them in that order).
    client.put("iter_0000013/__0_0.54a477811d26.distcp", b"x" * 100)
    client.put("iter_0000013/common.pt", b"its common state")
    saving = _objects(client, "iter_0000013")
    S3Root(loc).recover(nnodes=1)
    S3Root(loc).abort(13, CRASHED)
    assert _objects(client, "iter_0000013") == saving


def _commit(root: S3Root, step: int, attempt: str) -> None:
    """Commit a one-rank save of ``step``, and abort a commit that failed (the coordinator's way)."""
    try:
        commit_one_rank(root, step, attempt)
    except BaseException:
        root.abort(step, attempt)
        raise


def test_an_s3_commit_refuses_another_tools_checkpoint_of_its_step_and_replaces_its_own_leftovers(
    s3_bucket, single_process
):
    loc = _root(s3_bucket)
    root = S3Root(loc)
    ckptd.save({"w": torch.arange(8.0)}, loc.child("iter_0000010"))
    theirs = _objects(root.client, "iter_0000010")
    with pytest.raises(CheckpointExistsError, match=r"iter_0000010 holds a checkpoint ckptd did not commit") as err:
        _commit(root, 10, "fedcba987654-1")
    assert "__0_0." in str(err.value) and "save under another step, or move or delete" in str(err.value)
    assert _objects(root.client, "iter_0000010") == theirs  # the refused attempt's data object removed
    assert torch.equal(ckptd.load_plain_tensors(f"{loc}/iter_0000010")["w"], torch.arange(8.0))
    _crashed_commit(root.client, "iter_0000005")
    _commit(root, 5, "fedcba987654-1")  # a crashed commit's metadata objects are replaced
    record = read_s3_commit_record(root.client, "iter_0000005")
    assert record is not None and record.attempt == "fedcba987654-1"
    for name in (".metadata", "common.pt"):
        assert root.client.get(f"iter_0000005/{name}", 1 << 20)[0] != b"a crashed commit's"  # type: ignore[index]


@pytest.mark.timeout(180)
def test_a_save_of_a_step_holding_another_tools_checkpoint_fails_and_keeps_it(s3_bucket, runtime_dir):
    """A directory root refuses the save (the step directory exists); on S3 the commit deleted the
    step's ``.metadata``, ``common.pt`` and ``metadata.json`` and wrote its own: the other tool's
    data object stayed, named by nothing."""
    loc = _root(s3_bucket)
    root = str(loc)
    client = S3Client(loc)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            ckpt.save(_sd(torch.full((64,), 1.0), 1), step=1).wait(timeout_s=60)
            ckptd.save({"other": torch.arange(8.0)}, loc.child("iter_0000010"))  # while the job runs
            theirs = _objects(client, "iter_0000010")
            refused = ckpt.save(_sd(torch.full((64,), 10.0), 10), step=10)
            with pytest.raises(SaveFailedError, match=r"step 10 was not committed.*iter_0000010 holds a checkpoint"):
                refused.wait(timeout_s=60)
            assert _objects(client, "iter_0000010") == theirs
            assert ckpt.latest() == 1
            ckpt.save(_sd(torch.full((64,), 11.0), 11), step=11).wait(timeout_s=60)
            assert ckpt.latest() == 11
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000010")["other"], torch.arange(8.0))
