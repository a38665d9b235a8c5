"""A multi-node coordinator's start on an ``s3://`` root against a real server (SeaweedFS): another
node's rank may still be uploading an attempt of a running launch, so the start adopts what it
finds, and its abort after ``commit_timeout_s`` removes it unless it commits: also an attempt known
only by its unfinished multipart uploads, which the store otherwise keeps (and bills) for ever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.roots.s3_root import S3Root
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location, parse_location
from tests.multiproc import without_torchrun
from tests.objstore.commits import commit_one_rank
from tools.harness.ports import free_port
from tools.harness.waiting import wait_until

KILLED = "0123456789ab-7"  # the attempt of the job killed while every rank was uploading


def _upload_a_part(client: S3Client, key: str) -> None:
    """What a rank killed mid-upload leaves of its data object: one part, never completed."""
    boto = client._boto_client()
    full = client.location.key(key)
    started = boto.create_multipart_upload(Bucket=client.location.bucket, Key=full)
    boto.upload_part(
        Bucket=client.location.bucket, Key=full, UploadId=started["UploadId"], PartNumber=1, Body=bytes(5 << 20)
    )


@pytest.mark.timeout(120)
def test_several_nodes_adopt_an_attempt_known_only_by_its_uploads_but_none_of_a_committed_step(
    s3_bucket, single_process
):
    loc = parse_location(f"s3://{s3_bucket}/run")
    assert isinstance(loc, S3Location)
    client = S3Client(loc)
    commit_one_rank(S3Root(loc), 4, "0123456789ab-4")
    for rank in (0, 1):
        _upload_a_part(client, f"iter_0000005/__{rank}_0.{KILLED}.distcp")
    _upload_a_part(client, "iter_0000004/__1_0.0123456789ab-9.distcp")  # a committed step's: left to gc
    recovered = S3Root(loc).recover(nnodes=2)
    assert recovered.adopted == [(5, KILLED)] and not recovered.removed
    assert len(client.uploads("")) == 3  # adopted, not aborted: another node may still upload them
    S3Root(loc).abort(5, KILLED)  # what the coordinator does commit_timeout_s later
    assert [u.key for u in client.uploads("")] == ["iter_0000004/__1_0.0123456789ab-9.distcp"]


@pytest.mark.timeout(120)
def test_a_multi_node_coordinator_start_aborts_a_killed_jobs_uploads_after_the_commit_timeout(s3_bucket, runtime_dir):
    """The job was killed while every rank uploaded step 7 (no object of it completed): the
    coordinator's start adopted only attempts with a completed object, so the parts stayed."""
    root = f"s3://{s3_bucket}/run"
    client = S3Client(parse_location(root))
    for rank in (0, 1):
        _upload_a_part(client, f"iter_0000007/__{rank}_0.{KILLED}.distcp")
    env = without_torchrun(os.environ)
    env.update(
        CKPTD_RUNTIME_DIR=str(runtime_dir), CKPTD_HEARTBEAT_S="0.1", CKPTD_IDLE_EXIT_S="60", CKPTD_COMMIT_TIMEOUT_S="1"
    )
    port = free_port()
    cmd = [sys.executable, "-m", "ckptd.cli", "daemon", "--root", root, "--node", "0", "--nnodes", "2"]
    cmd += ["--coordinator-bind", f"tcp://127.0.0.1:{port}", "--detach"]
    started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    wait_until(lambda: not client.uploads(""), 30, "the adopted attempt's unfinished uploads to be aborted")
    cfg = CkptdConfig.from_env(env, coordinator_port=port)
    log = Endpoints.for_job(parse_location(root), JobEnv(world_size=2, node=0), cfg).log_path
    assert f"step 7 attempt {KILLED} aborted" in Path(log).read_text()
