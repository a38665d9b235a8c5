"""Checkpoints on S3-compatible object storage against a real server (SeaweedFS): a Checkpointer
on ``s3://bucket/prefix`` commits, loads bit-exact and resumes; a crashed attempt is invisible and
cleaned up; the commit point is one object; other URLs are refused instead of becoming local
directories."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor, commands
from ckptd.client.settle import DaemonsInFlight
from ckptd.errors import CheckpointExistsError, SaveFailedError, StorageError
from ckptd.format.commitrecord import COMMIT_RECORD
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import read_s3_commit_record
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import S3Location, UnsupportedLocationError, parse_location
from tests.multiproc import without_torchrun
from tools.harness.daemons import stop_root_daemons


def _config(runtime_dir: Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.2, **kw)


def _sd(w: torch.Tensor, step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", w), "iteration": step}


def _commit_steps_1_and_2(root: str, runtime_dir: Path) -> None:
    """A Checkpointer on ``root`` commits steps 1 and 2 (values 1 and 2); its daemon is stopped."""
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            for step in (1, 2):
                ckpt.save(_sd(torch.full((64,), float(step)), step), step=step).wait(timeout_s=60)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


def _abandon_step_20(ckpt: ckptd.Checkpointer) -> None:
    """Commit steps 10 and 20 (values 10 and 20), roll back to 10 and commit 11: step 20 is on an
    abandoned branch."""
    for step in (10, 20):
        ckpt.save(_sd(torch.full((64,), float(step)), step), step=step).wait(timeout_s=120)
    ckpt.load(_sd(torch.zeros(64), -1), step=10)
    ckpt.save(_sd(torch.full((64,), 11.0), 11), step=11).wait(timeout_s=120)


def _resumes(ckpt: ckptd.Checkpointer, value: float) -> None:
    """A resume loads 64 values ``value``."""
    w = torch.zeros(64)
    ckpt.load(_sd(w, -1))
    assert torch.equal(w, torch.full((64,), value))


@pytest.mark.timeout(180)
def test_a_checkpointer_on_s3_commits_loads_and_resumes(s3_bucket, runtime_dir):
    root = f"s3://{s3_bucket}/runs/job1"
    cfg = _config(runtime_dir, keep_last=2)
    values = {}
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            assert ckpt.latest() is None
            w = torch.randn(3 << 20)  # 12 MiB: several parts of a multipart upload
            for step in (10, 20, 30):
                values[step] = w.clone()
                h = ckpt.save(_sd(w, step), step=step)
                w.add_(1.0)  # training goes on while the daemon uploads
                assert h.wait(timeout_s=120) == parse_location(f"{root}/iter_{step:07d}")
            assert ckpt.latest() == 30
            # save() asks the store nothing (a round trip in every stall): the coordinator refuses.
            refused = ckpt.save(_sd(w, 30), step=30)
            with pytest.raises(SaveFailedError, match="step 30 is committed already"):
                refused.wait(timeout_s=60)
            assert ckpt.latest() == 30
        client = S3Client(parse_location(root))
        steps = sorted(d for d in client.list_dir("")[0] if d.startswith("iter_") and list(client.list_objects(d)))
        assert steps == ["iter_0000020", "iter_0000030"]  # keep_last=2 (SeaweedFS lists emptied "directories")
        names = {i.key.rsplit("/", 1)[-1] for i in client.list_objects("iter_0000030")}
        assert {".metadata", "metadata.json", "common.pt", COMMIT_RECORD} < names
        assert any(n.startswith("__0_0.") and n.endswith(".distcp") for n in names)  # the attempt is in the key
        assert client.get("latest", 100)[0] == b"iter_0000030\n"
        # A new job resumes from the object store, bit-exact.
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            x = torch.zeros(3 << 20)
            out = ckpt.load(_sd(x, -1))
            assert out["iteration"] == 30 and torch.equal(x, values[30])
            y = torch.zeros(3 << 20)
            ckpt.load(_sd(y, -1), step=20)
            assert torch.equal(y, values[20])
            # A resume settling saves in flight reads which attempt committed each step (ckptd.client.settle).
            reader = DaemonsInFlight(ckpt.root, 0, lambda: None, lambda _: None)
            assert reader.committed([(30, h.attempt), (30, "0123456789ab-9"), (40, h.attempt)]) == (
                {(30, h.attempt)},
                set(),
            )
        assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000020")["w"], values[20])
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(120)
def test_removing_the_committed_attempt_of_a_step_removes_nothing(s3_bucket, runtime_dir):
    """A coordinator killed after a step's commit object, and a node that aborted that attempt
    locally meanwhile: the next coordinator cleans up the node's abort. That removed the committed
    attempt's data objects (the crash matrix on S3 found step 4 loading wrong values)."""
    root = f"s3://{s3_bucket}/runs/committed-abort"
    w = torch.randn(1 << 16)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            ckpt.save(_sd(w, 4), step=4).wait(timeout_s=120)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    location = parse_location(root)
    record = read_s3_commit_record(S3Client(location), "iter_0000004")
    assert record is not None
    store = S3Root(location)
    # What a node asks when its coordinator was lost with the step pending (ckptd.daemon.uplinkstate).
    assert store.holds_commit(4, record.attempt)
    assert not store.holds_commit(4, "0123456789ab-9") and not store.holds_commit(5, record.attempt)
    store.abort(4, record.attempt)
    assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000004")["w"], w)
    assert store.holds_commit(4, record.attempt)


@pytest.mark.timeout(120)
def test_a_crashed_attempt_is_invisible_and_the_next_start_removes_it(s3_bucket, runtime_dir):
    root = f"s3://{s3_bucket}/r"
    client = S3Client(parse_location(root))
    # What a crash leaves: a step's data object of an attempt that never committed, an unfinished
    # multipart upload, and the metadata objects of a commit that died before its commit object.
    client.put("iter_0000005/__0_0.0123456789ab-1.distcp", b"x" * 100)
    client.put("iter_0000005/.metadata", b"not committed")
    writer = client.writer("iter_0000005/__1_0.0123456789ab-1.distcp", 5 << 20, 1)
    writer.write(bytes(6 << 20))  # one part uploaded, never completed
    # Another application's upload next to the steps is not ckptd's to abort (under s3://bucket,
    # a start aborted every unfinished upload of the bucket).
    boto = client._boto_client()
    theirs = boto.create_multipart_upload(Bucket=s3_bucket, Key="r/datasets/shard-0042.tar")
    assert len(client.uploads("")) == 2
    cfg = _config(runtime_dir)
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:  # starts the daemon: its coordinator cleans up
            assert ckpt.latest() is None
            assert not list(client.list_objects("iter_0000005"))
            assert [u.key for u in client.uploads("")] == ["datasets/shard-0042.tar"]
            boto.abort_multipart_upload(Bucket=s3_bucket, Key=theirs["Key"], UploadId=theirs["UploadId"])
            w = torch.arange(16.0)
            ckpt.save(_sd(w, 5), step=5).wait(timeout_s=60)
            assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000005")["w"], w)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


def test_urls_ckptd_cannot_store_at_are_refused(tmp_path, monkeypatch, single_process):
    monkeypatch.chdir(tmp_path)
    for url in ("gs://bucket/run", "http://host/run", "azure://c/run"):
        with pytest.raises(UnsupportedLocationError, match="is not supported"):
            ckptd.Checkpointer(url)
        with pytest.raises(UnsupportedLocationError):
            ckptd.load({}, url)
    assert not list(tmp_path.iterdir())  # no local directory named after a URL


def test_wrong_credentials_fail_at_once_with_a_clear_error(s3_bucket, monkeypatch, runtime_dir):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0123456789")
    with pytest.raises(StorageError, match="check the credentials") as err:
        ckptd.Checkpointer(f"s3://{s3_bucket}/run", config=_config(runtime_dir))
    assert "not-the-secret" not in str(err.value)


def test_a_missing_bucket_fails_at_once_saying_to_create_it(s3_env, runtime_dir):
    """A HEAD of a key in a missing bucket is a bodiless 404 (AWS S3, MinIO, SeaweedFS): it read as
    a missing object, and the Checkpointer started as if the bucket were there."""
    bucket = f"missing-{os.urandom(6).hex()}"
    with pytest.raises(StorageError, match=f"NoSuchBucket.*create the bucket '{bucket}' first"):
        ckptd.Checkpointer(f"s3://{bucket}/run", config=_config(runtime_dir))
    client = S3Client(S3Location(bucket=bucket, prefix="run"))
    with pytest.raises(StorageError, match="create the bucket"):
        client.get("latest", 100)  # a read says so too, instead of "no such object"


@pytest.mark.timeout(180)
def test_the_command_line_on_an_s3_root(s3_bucket, runtime_dir, capsys, monkeypatch):
    """Each command's logic runs in this process (``ckptd.commands.main``, what ``python -m
    ckptd.cli`` calls); the verdict on a damaged checkpoint comes from a real ``ckptd`` process."""
    root = f"s3://{s3_bucket}/cli"
    cfg = _config(runtime_dir)
    monkeypatch.setenv("CKPTD_RUNTIME_DIR", str(runtime_dir))
    env = {**without_torchrun(os.environ), "CKPTD_RUNTIME_DIR": str(runtime_dir)}

    def process(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "ckptd.cli", *argv], env=env, capture_output=True, text=True, timeout=120
        )

    def cli(*argv: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        rc = commands.main(list(argv))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["ckptd", *argv], rc, out, err)

    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            for step in (1, 2, 3):
                ckpt.save(_sd(torch.full((256,), float(step)), step), step=step).wait(timeout_s=60)
        run = cli("ls", root)
        assert run.returncode == 0 and "(latest: iter_0000003)" in run.stdout, run.stdout + run.stderr
        assert run.stdout.count("committed") == 3
        run = cli("verify", root)
        assert run.returncode == 0 and f"{root}/iter_0000003: OK" in run.stdout, run.stdout + run.stderr
        run = cli("inspect", f"{root}/iter_0000002")
        assert run.returncode == 0 and "w" in run.stdout, run.stderr
        # Bit rot in a data object: verify names the object.
        client = S3Client(parse_location(root))
        (data,) = [i.key for i in client.list_objects("iter_0000003") if i.key.endswith(".distcp")]
        raw = bytearray(client.get(data, 1 << 30)[0])
        raw[-200] ^= 0xFF
        client.delete([data])
        client.put(data, bytes(raw))
        run = process("verify", f"{root}/iter_0000003")
        assert run.returncode == 1 and f"{root}/iter_0000003: DAMAGED" in run.stdout, run.stdout
        assert f"of {data.rsplit('/', 1)[-1]} have CRC-32C" in run.stdout
        # Without --keep, gc removes a crashed save's leftovers and no committed step.
        stop_root_daemons(root, runtime_dir, timeout_s=60)  # its start would clean them up too
        client.put("iter_0000005/__0_0.0123456789ab-1.distcp", b"x" * 100)
        client.writer("iter_0000005/__1_0.0123456789ab-1.distcp", 5 << 20, 1).write(bytes(6 << 20))
        run = cli("gc", root, "--grace-s", "0")
        assert run.returncode == 0 and "removed iter_0000005" in run.stdout, run.stdout + run.stderr
        assert "removed 1 directory" in run.stdout and "kept iter_0000001: committed" in run.stdout, run.stdout
        assert not list(client.list_objects("iter_0000005")) and client.uploads("") == []
        run = cli("gc", root, "--keep", "1", "--grace-s", "0")
        assert run.returncode == 0, run.stdout + run.stderr
        assert "removed iter_0000001" in run.stdout and "removed iter_0000002" in run.stdout
        run = cli("ls", root)
        assert "iter_0000001" not in run.stdout and "iter_0000003" in run.stdout
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_a_resave_of_a_committed_step_under_a_repeated_attempt_id_changes_nothing(s3_bucket, runtime_dir):
    """A data object's key names its attempt, and attempt ids repeat (a second Checkpointer of a
    launch with a fixed CKPTD_RUN_ID): a re-save of a committed step under the same id would
    upload over the committed object. save() asks the store nothing, so the daemon's writer
    refuses it before uploading anything; the commit is untouched. A commit a rollback abandoned
    is replaced as ever, also under its own attempt id."""
    root = f"s3://{s3_bucket}/runs/repeated"
    cfg = _config(runtime_dir, run_id="fixed-launch")
    w = torch.arange(1 << 16, dtype=torch.float32)
    try:
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            first = ckpt.save(_sd(w, 3), step=3)
            first.wait(timeout_s=120)
            fourth = ckpt.save(_sd(w + 4, 4), step=4)
            fourth.wait(timeout_s=120)
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            again = ckpt.save(_sd(w + 1, 3), step=3)
            assert again.attempt == first.attempt
            with pytest.raises(SaveFailedError, match="step 3 is committed already"):
                again.wait(timeout_s=120)
            assert ckpt.latest() == 4
            ckpt.save(_sd(w + 2, 2), step=2).wait(timeout_s=120)  # a rollback: 3 and 4 are abandoned
        assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000003")["w"], w)
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            resaved = ckpt.save(_sd(w + 5, 4), step=4)
            assert resaved.attempt == fourth.attempt
            resaved.wait(timeout_s=120)
            assert ckpt.latest() == 4
        assert torch.equal(ckptd.load_plain_tensors(f"{root}/iter_0000004")["w"], w + 5)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


def _sync_save_ranks(rank: int, world_size: int, url: str, env: dict) -> list[float]:
    os.environ.update(env)
    w = torch.arange(64.0) + 100 * rank
    sd = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, world_size)), "epoch": 7}
    ckptd.save(sd, url)
    with pytest.raises(CheckpointExistsError):
        ckptd.save(sd, url)
    full = ckptd.load_plain_tensors(url)["w"]
    return full.tolist()


@pytest.mark.timeout(180)
def test_a_synchronous_save_to_s3_on_two_ranks(s3_bucket, s3_env):
    from tools.harness.ranks import run_ranks

    url = f"s3://{s3_bucket}/sync/ckpt1"
    results = run_ranks(_sync_save_ranks, 2, url, s3_env.env())
    expected = torch.arange(64.0).tolist() + (torch.arange(64.0) + 100).tolist()  # the two ranks' chunks
    assert results[0] == results[1] == expected
    assert ckptd.load_common_state_dict(url)["epoch"] == 7


def _sync_save_one_rank_without_credentials(rank: int, world_size: int, url: str, env: dict) -> str:
    os.environ.update(env)
    if rank == 1:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
            os.environ.pop(name, None)
        os.environ.update(
            AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
            AWS_CONFIG_FILE="/nonexistent",
            AWS_EC2_METADATA_DISABLED="true",
        )
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4), (0, rank, world_size))}
    try:
        ckptd.save(sd, url)
    except ckptd.CkptdError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.timeout(120)
def test_a_synchronous_save_to_s3_fails_on_every_rank_when_one_has_no_credentials(s3_bucket, s3_env):
    """The rank without credentials raised before the first collective, and the others waited for
    it there (a caller that catches the error and goes on: until the process group's timeout)."""
    from tools.harness.ranks import run_ranks

    url = f"s3://{s3_bucket}/sync/nocreds"
    results = run_ranks(_sync_save_one_rank_without_credentials, 2, url, s3_env.env(), timeout_s=60)
    assert all(r.startswith("StorageError") and "credentials" in r for r in results), results
    assert not list(S3Client(parse_location(url)).list_objects(""))


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_reads_a_committed_step_from_the_object_store(s3_bucket, runtime_dir):
    """torch DCP's fsspec reader (s3fs) loads a step ckptd committed, with its URL as checkpoint_id."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    root = f"s3://{s3_bucket}/dcp"
    w = torch.randn(256, 64)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            ckpt.save({"model": {"w": w}, "step": 5}, step=5).wait(timeout_s=60)
        state = {"model": {"w": torch.zeros(256, 64)}, "step": 0}
        dcp.load(state, storage_reader=FsspecReader(f"{root}/iter_0000005"))
        assert torch.equal(state["model"]["w"], w) and state["step"] == 5
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_gc_planned_before_a_re_save_of_an_abandoned_step_leaves_the_new_commit(s3_bucket, runtime_dir):
    """As tests/integration/test_rollback.py's POSIX case: ``ckptd gc`` scans, the job commits the
    abandoned step 20 again, then gc carries out its plan: the new step 20 stays."""
    from ckptd.retention import plan_gc
    from ckptd.roots.s3_root import apply_s3_gc
    from ckptd.s3catalog import scan_s3_root

    root = f"s3://{s3_bucket}/runs/gc-race"
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            for step, value in ((10, 1.0), (20, 2.0)):
                ckpt.save(_sd(torch.full((64,), value), step), step=step).wait(timeout_s=120)
            ckpt.load(_sd(torch.zeros(64), -1), step=10)
            ckpt.save(_sd(torch.full((64,), 11.0), 11), step=11).wait(timeout_s=120)
            location = parse_location(root)
            plan = plan_gc(scan_s3_root(location), keep=1, grace_s=3600.0)
            assert {r.entry.step for r in plan.remove} == {10, 20}
            ckpt.save(_sd(torch.full((64,), 20.5), 20), step=20).wait(timeout_s=120)
            results = apply_s3_gc(S3Root(location), plan, grace_s=3600.0)
            assert [r.entry.step for r, err in results] == [10]
            assert ckpt.latest() == 20
            _resumes(ckpt, 20.5)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_retiring_a_step_leaves_the_data_objects_of_a_re_save_in_flight(s3_bucket, runtime_dir):
    """gc (or retention) retiring the abandoned step 20 while a re-save of step 20 uploads its data
    objects: only the retired commit's objects go; the re-save's stay (they were deleted too, and
    that save then failed its commit's object check)."""
    from ckptd.retention import plan_gc
    from ckptd.roots.s3_root import apply_s3_gc
    from ckptd.s3catalog import scan_s3_root

    root = f"s3://{s3_bucket}/runs/retire"
    location = parse_location(root)
    client = S3Client(location)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            _abandon_step_20(ckpt)
        old = read_s3_commit_record(client, "iter_0000020")
        assert old is not None
        in_flight = "iter_0000020/__0_0.fedcba987654-1.distcp"  # another attempt's data object
        client.put(in_flight, b"x" * 64)
        plan = plan_gc(scan_s3_root(location), keep=1, grace_s=3600.0)
        assert 20 in {r.entry.step for r in plan.remove}
        apply_s3_gc(S3Root(location), plan, grace_s=3600.0)
        left = {i.key for i in client.list_objects("iter_0000020")}
        assert left == {in_flight}, left
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_gc_after_a_re_save_retired_the_abandoned_step_leaves_the_re_save_s_objects(s3_bucket, runtime_dir):
    """gc plans to remove the abandoned step 20; a re-save of step 20 then retires that commit (its
    data objects uploaded, its metadata and commit object not yet written) before gc carries out
    its plan. gc took the vanished commit object for "unchanged" and retired every attempt's data
    objects, the re-save's too: the re-save then committed a step without its data."""
    from ckptd.retention import plan_gc
    from ckptd.roots.s3_root import apply_s3_gc
    from ckptd.s3catalog import scan_s3_root

    root = f"s3://{s3_bucket}/runs/retired-since"
    location = parse_location(root)
    client = S3Client(location)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            _abandon_step_20(ckpt)
        plan = plan_gc(scan_s3_root(location), keep=1, grace_s=3600.0)
        assert 20 in {r.entry.step for r in plan.remove}
        new = "iter_0000020/__0_0.fedcba987654-1.distcp"  # the re-save's data object
        client.put(new, b"x" * 64)
        S3Root(location)._retire("iter_0000020", keep_attempt="fedcba987654-1")  # as its commit does first
        results = apply_s3_gc(S3Root(location), plan, grace_s=3600.0)
        assert 20 not in {r.entry.step for r, _ in results}
        assert any(e.step == 20 and "retired since the scan" in why for e, why in plan.kept), plan.kept
        assert {i.key for i in client.list_objects("iter_0000020")} == {new}
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_checkpoint_removed_from_the_store_while_it_is_loaded_is_a_removal(s3_bucket, monkeypatch, how):
    """Retention or gc deleted the step's objects while a load read it (no lease holds an object
    store), or another save replaced it: the missing data object was reported as damage ("the
    checkpoint is incomplete"), so a resume took the checkpoint for corrupt and fell back past it.
    A prefix that never held a checkpoint is still "not a checkpoint"."""
    import ckptd.loading.loader as loader
    from ckptd.format.layout import DCP_METADATA

    location = parse_location(f"s3://{s3_bucket}/root/iter_0000001")
    ckptd.save({"w": torch.ones(1024, 64)}, location)
    client = S3Client(location)
    execute = loader.execute

    def retire_meanwhile(*args, **kwargs):
        if how == "deleted":
            client.delete([i.key for i in client.list_objects("")])
        else:  # its data objects gone, its .metadata another save's
            client.delete([i.key for i in client.list_objects("") if i.key.endswith(".distcp")])
            got = client.get(DCP_METADATA, 1 << 20)
            assert got is not None
            client.put(DCP_METADATA, got[0] + b"\0")
        return execute(*args, **kwargs)

    monkeypatch.setattr(loader, "execute", retire_meanwhile)
    with pytest.raises(ckptd.CheckpointRemovedError, match="iter_0000001 was removed or replaced while it was being"):
        ckptd.load({"w": torch.zeros(1024, 64)}, location)
    with pytest.raises(ckptd.CheckpointNotFoundError, match="is not a checkpoint") as never:
        ckptd.load({"w": torch.zeros(1024, 64)}, parse_location(f"s3://{s3_bucket}/root/iter_0000002"))
    assert not isinstance(never.value, ckptd.CheckpointRemovedError)


@pytest.mark.timeout(120)
def test_a_store_outage_while_the_latest_is_checked_is_an_error_not_damage(s3_bucket, monkeypatch, runtime_dir):
    """A request of the structural check failing for good (the store down past its retries) read
    as damage: the resume fell back to an older step, the next commit made the newer ones an
    abandoned branch, and retention removed them."""
    from ckptd.format.layout import DCP_METADATA
    from ckptd.recovery import resolve_latest

    root = f"s3://{s3_bucket}/outage"
    _commit_steps_1_and_2(root, runtime_dir)
    get = S3Client.get

    def failing_get(self, name, *args, **kwargs):
        if self.url(name) == f"{root}/iter_0000002/{DCP_METADATA}":
            raise StorageError(f"{self.url(name)}: 503 Slow Down (tries exhausted)")
        return get(self, name, *args, **kwargs)

    monkeypatch.setattr(S3Client, "get", failing_get)
    with pytest.raises(StorageError, match="503 Slow Down"):  # before: iter_0000001, "iter_0000002 is damaged"
        resolve_latest(root)
    monkeypatch.setattr(S3Client, "get", get)
    choice = resolve_latest(root)
    assert choice is not None and choice.step == 2 and choice.fallback_reason is None


@pytest.mark.timeout(180)
def test_gc_of_an_abandoned_partial_step_leaves_what_a_new_save_of_it_wrote(s3_bucket, runtime_dir):
    """``ckptd gc`` found step 30 partial (a dead attempt's leftovers), then the job saved step 30:
    gc removed everything under the step, the new commit object, metadata and data included, and
    ``latest`` named a removed step. Now it keeps a step committed since the scan, and of one still
    partial removes only what was written before its grace period."""
    from ckptd.retention import plan_gc
    from ckptd.roots.s3_root import apply_s3_gc
    from ckptd.s3catalog import scan_s3_root

    root = f"s3://{s3_bucket}/runs/gc-partial"
    location = parse_location(root)
    client = S3Client(location)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            ckpt.save(_sd(torch.full((64,), 10.0), 10), step=10).wait(timeout_s=120)
            for step in (30, 40):  # after the daemon's start, which removes such leftovers
                client.put(f"iter_00000{step}/__0_0.deadbeef0000-1.distcp", b"x" * 64)
            # The store's times have whole seconds: the grace leaves the in-flight object below 3 s
            # of margin under load (with 1 s, a slow gc took it for older than its grace).
            time.sleep(6.0)
            plan = plan_gc(scan_s3_root(location), keep=10, grace_s=4.0)
            assert {r.entry.name for r in plan.remove} == {"iter_0000030", "iter_0000040"}
            ckpt.save(_sd(torch.full((64,), 30.0), 30), step=30).wait(timeout_s=120)
            in_flight = "iter_0000040/__0_0.0123456789ab-1.distcp"  # a save of step 40 uploading
            client.put(in_flight, b"y" * 64)
            results = apply_s3_gc(S3Root(location), plan, grace_s=4.0)
            assert [(r.entry.name, err) for r, err in results] == [("iter_0000040", None)]
            assert {i.key for i in client.list_objects("iter_0000040")} == {in_flight}
            assert ckpt.latest() == 30
            _resumes(ckpt, 30.0)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_retiring_a_step_leaves_a_commit_of_it_that_lands_meanwhile(s3_bucket, runtime_dir, monkeypatch):
    """gc retires the abandoned step 20 (its commit object first, then a listing of what is left)
    while the job commits step 20 again: the new commit's metadata and commit object, landing
    between the two, were removed with the retired commit's."""
    from ckptd.retention import plan_gc
    from ckptd.roots.s3_root import apply_s3_gc
    from ckptd.s3catalog import scan_s3_root

    root = f"s3://{s3_bucket}/runs/retire-race"
    location = parse_location(root)
    client = S3Client(location)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            _abandon_step_20(ckpt)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    plan = plan_gc(scan_s3_root(location), keep=1, grace_s=3600.0)
    assert 20 in {r.entry.step for r in plan.remove}
    names = [f"iter_0000020/{n}" for n in ("metadata.json", ".metadata", "common.pt", COMMIT_RECORD)]
    new = {name: client.get(name, 1 << 20)[0] + b" " for name in names}  # a re-commit's (the bytes differ)
    time.sleep(1.1)
    delete = S3Client.delete

    def commit_meanwhile(self, keys):
        delete(self, keys)
        if keys == ["iter_0000020/" + COMMIT_RECORD]:
            for name, data in new.items():
                client.put(name, data)

    monkeypatch.setattr(S3Client, "delete", commit_meanwhile)
    apply_s3_gc(S3Root(location), plan, grace_s=3600.0)
    monkeypatch.setattr(S3Client, "delete", delete)
    assert {name: client.get(name, 1 << 20)[0] for name in names} == new


@pytest.mark.timeout(60)
def test_the_uploads_of_a_root_are_not_those_of_a_sibling_whose_name_it_begins(s3_bucket):
    """``run1``'s unfinished uploads listed ``run10``'s too (an S3 prefix is no directory): a
    daemon's start or ``ckptd gc`` then aborted keys it does not own, or failed."""
    sibling = S3Client(parse_location(f"s3://{s3_bucket}/runs/run10"))
    boto = sibling._boto_client()
    up = boto.create_multipart_upload(Bucket=s3_bucket, Key="runs/run10/iter_0000001/__0_0.a-1.distcp")
    try:
        assert S3Client(parse_location(f"s3://{s3_bucket}/runs/run1")).uploads("") == []
        assert [u.key for u in sibling.uploads("")] == ["iter_0000001/__0_0.a-1.distcp"]
    finally:
        boto.abort_multipart_upload(Bucket=s3_bucket, Key=up["Key"], UploadId=up["UploadId"])


@pytest.mark.timeout(120)
def test_loading_a_step_of_an_s3_root_that_has_no_commit_object_is_refused(s3_bucket, runtime_dir):
    """A step whose metadata objects are written but whose commit object is not (a commit in
    flight, or one taken back) loaded as a plain checkpoint through ``load(step=N)``."""
    root = f"s3://{s3_bucket}/uncommitted"
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            ckpt.save(_sd(torch.full((64,), 1.0), 1), step=1).wait(timeout_s=60)
            ckptd.save({"w": torch.full((64,), 2.0)}, parse_location(f"{root}/iter_0000002"))  # no commit object
            with pytest.raises(ckptd.CheckpointNotFoundError, match="iter_0000002 is not a committed checkpoint"):
                ckpt.load(_sd(torch.zeros(64), -1), step=2)
            with pytest.raises(ckptd.CheckpointNotFoundError, match="not a committed checkpoint"):
                ckpt.checkpoint_dir(2)
            w = torch.zeros(64)
            ckpt.load(_sd(w, -1), step=1)
            assert torch.equal(w, torch.full((64,), 1.0)) and ckpt.latest() == 1
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(120)
def test_a_metadata_object_that_is_not_the_one_committed_is_damage(s3_bucket, runtime_dir):
    """Every rank reads ``common.pt`` and ``.metadata`` whole: one the commit did not record (a
    replaced or damaged object) fails the load, and a larger one is refused by the size the commit
    recorded before its bytes are read (before: by a limit of 64 GiB)."""
    from ckptd.format.layout import COMMON_PT

    root = f"s3://{s3_bucket}/replaced"
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            ckpt.save(_sd(torch.arange(64.0), 1), step=1).wait(timeout_s=60)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    client = S3Client(parse_location(root))
    original = client.get(f"iter_0000001/{COMMON_PT}", 1 << 20)[0]
    location = parse_location(f"{root}/iter_0000001")
    for replacement, match in (
        (bytes(len(original)), "is not the object its commit .* recorded"),
        (original + bytes(1 << 20), r"common.pt \(its commit recorded \d+ bytes\) .* has \d+ bytes"),
    ):
        client.put(f"iter_0000001/{COMMON_PT}", replacement)
        with pytest.raises(ckptd.CorruptCheckpointError, match=match):
            ckptd.load(_sd(torch.zeros(64), -1), location)
    client.put(f"iter_0000001/{COMMON_PT}", original)
    w = torch.zeros(64)
    ckptd.load(_sd(w, -1), location)
    assert torch.equal(w, torch.arange(64.0))


@pytest.mark.timeout(60)
def test_a_full_tmpdir_while_loading_from_s3_says_where_and_what_to_do(s3_bucket, monkeypatch):
    """The view keeps what a load fetches in $TMPDIR: a full one was a bare OSError naming nothing."""
    import errno

    import ckptd.storage.s3view as s3view

    location = parse_location(f"s3://{s3_bucket}/tmpdir/ckpt")
    ckptd.save({"w": torch.arange(1024.0)}, location)

    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(s3view.os, "pwrite", full)
    with pytest.raises(StorageError, match=r"tmpdir/ckpt/__0_0\..*No space left on device; .*\$TMPDIR"):
        ckptd.load({"w": torch.zeros(1024)}, location)


@pytest.mark.timeout(120)
def test_a_checkpoint_retired_while_a_resume_checks_it_is_a_removal_not_damage(s3_bucket, monkeypatch, runtime_dir):
    """Retention retires a step by its commit object first: a structural check that opened it after
    that found "not a checkpoint" (or a half-removed one) and took the step for damaged, so the
    resume fell back past it instead of scanning again."""
    import ckptd.recovery as recovery
    from ckptd.format.layout import DCP_METADATA

    root = f"s3://{s3_bucket}/retired-while-checked"
    _commit_steps_1_and_2(root, runtime_dir)
    client = S3Client(parse_location(root))
    view = recovery.s3_checkpoint_view

    def retired_first(location, *args, **kwargs):
        if location.name == "iter_0000002":
            client.delete([f"iter_0000002/{COMMIT_RECORD}", f"iter_0000002/{DCP_METADATA}"])
        return view(location, *args, **kwargs)

    monkeypatch.setattr(recovery, "s3_checkpoint_view", retired_first)
    with pytest.raises(ckptd.CheckpointRemovedError, match="iter_0000002 was removed while it was checked"):
        recovery.resolve_latest(root)  # before: iter_0000001, "iter_0000002 ... is damaged"


@pytest.mark.timeout(180)
def test_a_resume_past_a_step_that_lost_an_object_can_save_that_step_again(s3_bucket, runtime_dir):
    """Step 20 lost a data object; a restart resumes step 10 and trains on to step 20, whose save
    the coordinator refused ("committed already"): the job could never get past it. A commit of a
    step whose objects are not all there replaces it."""
    root = f"s3://{s3_bucket}/runs/lost-object"
    location = parse_location(root)
    client = S3Client(location)
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            for step in (10, 20):
                ckpt.save(_sd(torch.full((64,), float(step)), step), step=step).wait(timeout_s=120)
        client.delete([i.key for i in client.list_objects("iter_0000020") if i.key.endswith(".distcp")])
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            _resumes(ckpt, 10.0)
            handle = ckpt.save(_sd(torch.full((64,), 20.5), 20), step=20)
            handle.wait(timeout_s=120)
            assert any("committed before the job loaded step 10, was replaced" in t for t in handle.warnings), (
                handle.warnings
            )
            assert ckpt.latest() == 20
            _resumes(ckpt, 20.5)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_a_rollback_on_s3_saves_again_at_the_steps_it_left(s3_bucket, runtime_dir):
    """Go back to step 10 and save step 20 again, as the saves every 10 steps before did: the
    coordinator refused it (the old 20 was an ancestor of the latest, 30)."""
    root = f"s3://{s3_bucket}/runs/went-back"
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir, keep_last=10)) as ckpt:
            for step in (10, 20, 30):
                ckpt.save(_sd(torch.full((64,), float(step)), step), step=step).wait(timeout_s=120)
            ckpt.load(_sd(torch.zeros(64), -1), step=10)
            again = ckpt.save(_sd(torch.full((64,), 20.5), 20), step=20)
            again.wait(timeout_s=120)
            assert any("committed before the job loaded step 10, was replaced" in t for t in again.warnings), (
                again.warnings
            )
            assert ckpt.latest() == 20
            _resumes(ckpt, 20.5)
            # Committed after the resume: once (the store's commit times were read as 0: every
            # step above the one loaded passed for one the job had left, and was replaced).
            twice = ckpt.save(_sd(torch.full((64,), 20.75), 20), step=20)
            with pytest.raises(SaveFailedError, match="committed already"):
                twice.wait(timeout_s=120)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)


def test_gc_of_an_s3_root_never_removes_a_checkpoint_another_tool_wrote_there(s3_bucket, single_process):
    """A step without a commit object is PARTIAL on an object store, and gc removed every one past
    the grace time: also a checkpoint ckptd.save or torch DCP wrote into the root, metadata and
    all. One with metadata is kept (remove it by hand); an attempt's leftovers without are not."""
    from ckptd.retention import plan_gc
    from ckptd.s3catalog import scan_s3_root

    root = parse_location(f"s3://{s3_bucket}/run")
    assert isinstance(root, S3Location)
    ckptd.save({"w": torch.arange(8.0)}, root.child("iter_0000010"))
    client = S3Client(root)
    client.put("iter_0000020/__0_0.0123456789ab-1.distcp", b"x" * 64)  # a crashed attempt's object
    plan = plan_gc(scan_s3_root(root, client), keep=1, grace_s=0.0)
    assert [r.entry.name for r in plan.remove] == ["iter_0000020"]
    kept = {e.name: why for e, why in plan.kept}
    assert "another tool's checkpoint" in kept["iter_0000010"]
