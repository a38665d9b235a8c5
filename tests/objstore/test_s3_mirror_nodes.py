"""The mirror copy of a commit held by node-local disks, against a real server (SeaweedFS): node 0's
and node 1's mirror threads (ckptd.daemon.mirror, made by ``daemon_mirror`` as a daemon makes
them) run in this process on two local roots, each holding only its own rank's data file of one
committed two-rank step, and copy it together through the store (ckptd.roots.mirror_nodes)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.daemon.mirror import MirrorUploader
from ckptd.daemon.store import daemon_mirror
from ckptd.format.commitrecord import COMMIT_RECORD, CommitRecord
from ckptd.format.dcp_metadata import read_index, records_from_index, with_file_ranks
from ckptd.format.layout import COMMON_PT, DCP_METADATA, METADATA_JSON, data_file_name
from ckptd.format.rootlayout import TRACKER_FILE, step_dir_name, tmp_dir, tracker_bytes
from ckptd.roots.copyround import REQUEST_KEY, build_request
from ckptd.roots.mirror import CommitRef
from ckptd.s3catalog import read_s3_commit_record, scan_s3_root
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import parse_location
from tests.checkpoints import flip_bit, make_checkpoint
from tests.objstore.test_s3_roots import _config
from tools.harness.waiting import wait_until

STEP = 7
ATTEMPT = "0123456789ab-1"
SEQ = 3
META = (COMMON_PT, DCP_METADATA, METADATA_JSON, COMMIT_RECORD)


def _disks(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Node 0's and node 1's local roots after the commit (STEP, ATTEMPT, SEQ) of a two-rank save:
    each ``iter_<STEP>/`` holds its node's rank's data file and the same four metadata files."""
    full = tmp_path / "written" / step_dir_name(STEP)
    ref = make_checkpoint(full, step=STEP)  # ckptd's own writer: __0_0.distcp, __1_0.distcp, metadata
    record = CommitRecord(seq=SEQ, step=STEP, attempt=ATTEMPT, committed_unix_s=time.time())
    (full / COMMIT_RECORD).write_bytes(record.to_bytes())
    roots = []
    for node in (0, 1):
        root = tmp_path / f"node{node}"
        shutil.copytree(full, root / step_dir_name(STEP))
        (root / step_dir_name(STEP) / data_file_name(1 - node)).unlink()  # the other node's rank
        (root / TRACKER_FILE).write_bytes(tracker_bytes(step_dir_name(STEP)))
        roots.append(root)
    return roots[0], roots[1], ref


def _threads(root0: Path, root1: Path | None, url: str, runtime_dir: Path, **cfg) -> list[MirrorUploader]:
    config = _config(runtime_dir, mirror=url, node_local=True, **cfg)
    threads = []
    for node, root in ((0, root0), (1, root1)):
        if root is not None:
            uploader = daemon_mirror(root, config, node=node, nnodes=2)
            assert isinstance(uploader, MirrorUploader) and uploader.node == node
            uploader.start()
            threads.append(uploader)
    return threads


def _stop(threads: list[MirrorUploader]) -> None:
    for t in threads:
        t.stop(30)


def _item_of_rank(directory: Path, rank: int):
    return next(r for r in with_file_ranks(records_from_index(read_index(directory))) if r.rank == rank)


@pytest.mark.timeout(120)
def test_each_node_uploads_its_own_files_and_node_0_commits_the_copy(s3_bucket, runtime_dir, tmp_path):
    root0, root1, ref = _disks(tmp_path)
    url = f"s3://{s3_bucket}/mirror/nodes"
    threads = _threads(root0, root1, url, runtime_dir)
    try:
        status = wait_until(
            lambda: (s := threads[0].status())["mirrored_step"] == STEP and s, 60, "the copy of the step to commit"
        )
        assert status["error"] is None and status["failed_node"] is None, status
        answered = wait_until(lambda: threads[1].status()["last_upload"], 30, "node 1 to report its part")
        assert answered["step"] == STEP and answered["objects"] == 1 and answered["error"] is None, answered
    finally:
        _stop(threads)
    location = parse_location(url)
    client = S3Client(location)
    record = read_s3_commit_record(client, step_dir_name(STEP))
    assert record is not None and record.source == {"seq": SEQ, "attempt": ATTEMPT}
    plain = ckptd.load_plain_tensors(location.child(step_dir_name(STEP)))
    for key, tensor in ref.items():
        assert torch.equal(plain[key], tensor), key
    # One data object per rank, under the round's one mirror attempt; the request and the
    # manifests are gone.
    names = sorted(i.key.rsplit("/", 1)[-1] for i in client.list_objects(step_dir_name(STEP)))
    data = [n for n in names if n.endswith(".distcp")]
    assert len(data) == 2 and data[0].startswith("__0_0.") and data[1].startswith("__1_0.")
    assert data[0].split(".")[1] == data[1].split(".")[1] == record.attempt
    assert not [n for n in names if n.startswith("ckptd_copy")], names
    assert client.head(REQUEST_KEY) is None


@pytest.mark.timeout(120)
def test_a_node_whose_daemon_died_before_its_rename_uploads_from_its_attempt_directory(
    s3_bucket, runtime_dir, tmp_path
):
    root0, root1, ref = _disks(tmp_path)
    committed = root1 / step_dir_name(STEP)
    attempt_dir = tmp_dir(root1, STEP, ATTEMPT)
    attempt_dir.mkdir()
    shutil.move(committed / data_file_name(1), attempt_dir / data_file_name(1))
    (attempt_dir / f"{data_file_name(3)}.x1.part").write_bytes(b"an unfinished write")  # not in the request
    # An older commit of the step still sits in iter_<STEP>/ on node 1: another attempt, other bytes.
    stale = CommitRecord(seq=1, step=STEP, attempt="0123456789ab-2", committed_unix_s=1.0)
    (committed / COMMIT_RECORD).write_bytes(stale.to_bytes())
    (committed / data_file_name(1)).write_bytes(b"\0" * (attempt_dir / data_file_name(1)).stat().st_size)
    url = f"s3://{s3_bucket}/mirror/tmpdir"
    threads = _threads(root0, root1, url, runtime_dir)
    try:
        status = wait_until(
            lambda: (s := threads[0].status())["mirrored_step"] == STEP and s, 60, "the copy of the step to commit"
        )
        assert status["error"] is None, status
    finally:
        _stop(threads)
    plain = ckptd.load_plain_tensors(parse_location(url).child(step_dir_name(STEP)))
    for key, tensor in ref.items():
        assert torch.equal(plain[key], tensor), key


@pytest.mark.timeout(120)
def test_a_bit_flip_on_one_node_fails_the_round_and_nothing_stays_in_the_mirror(s3_bucket, runtime_dir, tmp_path):
    root0, root1, _ = _disks(tmp_path)
    directory = root1 / step_dir_name(STEP)
    item = _item_of_rank(directory, 1)
    flip_bit(directory / data_file_name(1), item.file_offset + item.length // 2)
    url = f"s3://{s3_bucket}/mirror/flip"
    threads = _threads(root0, root1, url, runtime_dir)
    try:
        error = wait_until(lambda: threads[0].status()["error"], 60, "the round to fail")
        status = threads[0].status()
        assert status["failed_node"] == 1 and status["failed_step"] == STEP, status
        assert error.startswith("node 1: ") and "no longer matches its recorded checksum" in error, error
        assert data_file_name(1) in error, error
        assert threads[1].status()["last_upload"]["error"] is not None
    finally:
        _stop(threads)
    location = parse_location(url)
    client = S3Client(location)
    assert not scan_s3_root(location, usage=False).committed
    assert not list(client.list_objects("")) and not client.uploads("")  # node 0's object of the round too


@pytest.mark.timeout(120)
def test_a_node_that_never_answers_fails_the_round_at_its_deadline_naming_it(s3_bucket, runtime_dir, tmp_path):
    root0, _, _ = _disks(tmp_path)
    url = f"s3://{s3_bucket}/mirror/missing"
    threads = _threads(root0, None, url, runtime_dir, mirror_timeout_s=2.0)  # no thread of node 1
    try:
        error = wait_until(lambda: threads[0].status()["error"], 60, "the round's deadline")
        assert threads[0].status()["failed_node"] == 1
        assert error.startswith("node 1 did not answer the copy request") and "within 2 s" in error, error
    finally:
        _stop(threads)
    location = parse_location(url)
    client = S3Client(location)
    assert not scan_s3_root(location, usage=False).committed
    assert not list(client.list_objects("")) and not client.uploads("")


@pytest.mark.timeout(120)
def test_a_dead_node_0s_request_is_withdrawn_and_what_its_round_left_late_is_swept(s3_bucket, runtime_dir, tmp_path):
    root0, root1, ref = _disks(tmp_path)
    url = f"s3://{s3_bucket}/mirror/stale"
    location = parse_location(url)
    threads = _threads(root0, root1, url, runtime_dir)
    try:
        wait_until(lambda: threads[0].status()["mirrored_step"] == STEP, 60, "the copy of the step to commit")
    finally:
        _stop(threads)
    # Node 0's daemon died in a later round of the step: its request stays, and node 1 completed an
    # object and its manifest after that, inside the committed copy (a recovery keeps it).
    client = S3Client(location)
    old = build_request(CommitRef(step=STEP, attempt=ATTEMPT, seq=SEQ), f"{ATTEMPT}-m00000001", 2, [], None)
    client.put(REQUEST_KEY, old.to_bytes())
    client.put(old.object_key(1), b"late bytes")
    client.put(old.manifest_key(1), b"{}")
    threads = _threads(root0, None, url, runtime_dir, mirror_timeout_s=1.0)  # node 0's next daemon
    try:
        wait_until(lambda: client.head(REQUEST_KEY) is None, 30, "the stale request to be withdrawn")
        # Swept a round's deadline later, at the next pass (kick: no 30 s wait for it).
        wait_until(
            lambda: threads[0].kick() or (client.head(old.object_key(1)) or client.head(old.manifest_key(1))) is None,
            30,
            "the late object and manifest to be swept",
        )
    finally:
        _stop(threads)
    plain = ckptd.load_plain_tensors(location.child(step_dir_name(STEP)))  # the copy is untouched
    for key, tensor in ref.items():
        assert torch.equal(plain[key], tensor), key


@pytest.mark.timeout(60)
def test_without_node_local_only_node_0_has_a_mirror_thread(s3_bucket, runtime_dir, tmp_path):
    url = f"s3://{s3_bucket}/mirror/shared"
    shared = _config(runtime_dir, mirror=url)
    assert daemon_mirror(tmp_path, shared, node=1, nnodes=2) is None
    only = daemon_mirror(tmp_path, shared, node=0, nnodes=2)
    assert only is not None and not only.coordinated  # a shared root: node 0 copies every file
    local = daemon_mirror(tmp_path, _config(runtime_dir, mirror=url, node_local=True), node=0, nnodes=1)
    assert local is not None and not local.coordinated  # one node: its disk holds every file


@pytest.mark.timeout(120)
def test_a_node_whose_manifest_upload_failed_answers_the_round_again(s3_bucket, runtime_dir, tmp_path):
    """Node 1's manifest PUT fails once (a store error): it never answered that round again, and
    node 0 waited for it until the round's deadline (10 minutes by default) before retrying."""
    from ckptd.errors import StorageError

    root0, root1, ref = _disks(tmp_path)
    url = f"s3://{s3_bucket}/mirror/manifest-retry"
    config = _config(runtime_dir, mirror=url, node_local=True)
    threads = [daemon_mirror(root, config, node=node, nnodes=2) for node, root in ((0, root0), (1, root1))]
    node1 = threads[1]
    assert isinstance(node1, MirrorUploader) and threads[0] is not None
    node1.retry_after_s = 0.5
    real_put, failures = node1.mirror.client.put, []

    def put(key: str, data: bytes, **kw):
        if ".node1.json" in key and not failures:
            failures.append(key)
            raise StorageError(f"PUT {key}: injected failure (a store error after retries)")
        return real_put(key, data, **kw)

    node1.mirror.client.put = put  # type: ignore[method-assign]
    for t in threads:
        t.start()
    try:
        status = wait_until(
            lambda: (s := threads[0].status())["mirrored_step"] == STEP and s, 60, "the copy of the step to commit"
        )
        assert failures and status["error"] is None, status
    finally:
        _stop(threads)
    plain = ckptd.load_plain_tensors(parse_location(url).child(step_dir_name(STEP)))
    assert all(torch.equal(plain[key], tensor) for key, tensor in ref.items())
