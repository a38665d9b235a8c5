"""Checkpoints another tool wrote into an ``s3://`` root (``ckptd.save``, torch DCP): a step with
metadata but no ``ckptd_commit.json``. A Checkpointer's start never removes one (it removed every
uncommitted step's objects, and with several nodes adopted ``ckptd.save``'s data object as an
attempt, whose abort removed the metadata); a crashed Checkpointer attempt's leftovers are still
removed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.roots.s3_root import S3Root
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location, parse_location
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
