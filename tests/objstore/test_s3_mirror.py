"""Two tiers against a real server (SeaweedFS): a local root whose committed steps the coordinator's
daemon copies to an ``s3://`` mirror in the background. A replaced node (an empty local root)
resumes from the mirror bit-exact and then saves locally again; a local bit flip is refused, never
copied."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import ckptd
from ckptd.control.pidfile import daemon_pid
from ckptd.errors import CheckpointExistsError
from ckptd.format.commitrecord import read_commit_record
from ckptd.roots.mirror import local_latest, mirror_step
from ckptd.roots.s3_root import S3Root
from ckptd.s3catalog import read_s3_commit_record, scan_s3_root
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import UnsupportedLocationError, parse_location
from tests.multiproc import without_torchrun
from tests.objstore.test_s3_roots import _config, _sd
from tools.harness.daemons import stop_root_daemons
from tools.harness.waiting import wait_for_exit, wait_until


@pytest.mark.timeout(240)
def test_a_mirrored_root_resumes_from_the_store_on_a_replaced_node(s3_bucket, runtime_dir, tmp_path):
    local = tmp_path / "local"
    mirror = f"s3://{s3_bucket}/mirror/job1"
    cfg = _config(runtime_dir, keep_last=1, mirror=mirror, mirror_keep_last=2)
    values = {}
    try:
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            w = torch.randn(3 << 20)  # 12 MiB: several parts of a multipart upload
            for step in (10, 20, 30):
                values[step] = w.clone()
                ckpt.save(_sd(w, step), step=step).wait(timeout_s=120)
                w.add_(1.0)
            ckpt.wait_mirrored(30, timeout_s=120)
            # The daemon's status names the copy once its upload returned, a moment after the
            # commit object that wait_mirrored() polls for appeared in the store.
            status = wait_until(
                lambda: (s := ckpt.status()["mirror"])["mirrored_step"] == 30 and s, 30, "the status to name step 30"
            )
            assert status["error"] is None, status
            assert ckpt.latest() == 30
            env = {**without_torchrun(os.environ), "CKPTD_RUNTIME_DIR": str(runtime_dir)}
            cli = [sys.executable, "-m", "ckptd.cli", "status", str(local)]
            shown = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
            assert f"mirror {mirror}: latest copy step 30" in shown.stdout, shown.stdout + shown.stderr
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    location = parse_location(mirror)
    cat = scan_s3_root(location, usage=False)
    mirrored = [e.step for e in cat.committed]
    assert 30 in mirrored and len(mirrored) <= 2, mirrored  # mirror_keep_last=2; a lagging mirror skips steps
    record = read_s3_commit_record(S3Client(location), "iter_0000030")
    local_record = read_commit_record(local / "iter_0000030")
    assert record is not None and local_record is not None
    assert record.source == {"seq": local_record.seq, "attempt": local_record.attempt}
    assert torch.equal(ckptd.load_plain_tensors(f"{mirror}/iter_0000030")["w"], values[30])

    # A replaced node: its local disk is empty. The job resumes from the mirror, bit-exact ...
    shutil.rmtree(local)
    try:
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            assert ckpt.latest() == 30
            x = torch.zeros(3 << 20)
            assert ckpt.load(_sd(x, -1))["iteration"] == 30
            assert torch.equal(x, values[30])
            # ... and its next save commits locally first: the local root is newer from then on.
            ckpt.save(_sd(x, 40), step=40).wait(timeout_s=120)
            assert ckpt.latest() == 40
            y = torch.zeros(3 << 20)
            ckpt.load(_sd(y, -1))
            assert torch.equal(y, x)
            ckpt.wait_mirrored(40, timeout_s=120)
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_a_local_bit_flip_is_never_copied_to_the_mirror(s3_bucket, runtime_dir, tmp_path):
    local = tmp_path / "local"
    mirror = f"s3://{s3_bucket}/mirror/rot"
    w = torch.randn(1 << 16)
    try:
        with ckptd.Checkpointer(local, config=_config(runtime_dir)) as ckpt:  # no mirror yet
            ckpt.save(_sd(w, 7), step=7).wait(timeout_s=120)
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    data = local / "iter_0000007" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(raw)
    try:
        # The coordinator's first mirror pass copies the local latest: it finds the flip.
        with ckptd.Checkpointer(local, config=_config(runtime_dir, mirror=mirror)) as ckpt:
            status = wait_until(lambda: ckpt.status()["mirror"]["error"], 60, "the mirror to report the flip")
            assert "iter_0000007" in status and "no longer matches its recorded checksum" in status, status
            assert ckpt.status()["mirror"]["failed_step"] == 7
            # It can never succeed: not retried (each retry uploaded everything up to the damage again).
            assert "not retrying it: a newer local commit is copied" in ckpt.endpoints.log_path.read_text()
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    location = parse_location(mirror)
    assert not scan_s3_root(location, usage=False).committed
    assert not list(S3Client(location).list_objects("")) and not S3Client(location).uploads("")


@pytest.mark.timeout(240)
def test_a_copy_killed_midway_leaves_nothing_and_the_next_daemon_copies_again(s3_bucket, runtime_dir, tmp_path):
    local = tmp_path / "local"
    mirror = f"s3://{s3_bucket}/mirror/killed"
    cfg = _config(runtime_dir, mirror=mirror)
    w = torch.randn(24 << 20)  # 96 MiB: three multipart parts, seconds of copying
    location = parse_location(mirror)
    client = S3Client(location)
    try:
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            ckpt.save(_sd(w, 5), step=5).wait(timeout_s=120)
            wait_until(lambda: ckpt.status()["mirror"]["uploading_step"] == 5, 60, "the copy of step 5 to start")
            wait_until(lambda: client.uploads(""), 60, "a multipart upload of the copy")  # mid-copy
            pid = daemon_pid(ckpt.endpoints.pid_path)
            os.kill(pid, signal.SIGKILL)
            wait_for_exit(pid, 30)
        assert not scan_s3_root(location, usage=False).committed  # nothing of the copy is visible
        # The next coordinator start removes the dead copy's upload and copies the step again.
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            ckpt.wait_mirrored(5, timeout_s=120)
        assert not client.uploads("")
        keys = [i.key for i in client.list_objects("iter_0000005") if i.key.endswith(".distcp")]
        assert len(keys) == 1, keys  # the dead copy's data object never completed
        assert torch.equal(ckptd.load_plain_tensors(f"{mirror}/iter_0000005")["w"], w)
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)


@pytest.mark.timeout(180)
def test_a_re_save_after_a_rollback_replaces_the_mirrors_copy_of_the_step(s3_bucket, runtime_dir, tmp_path):
    local = tmp_path / "local"
    store = S3Root(parse_location(f"s3://{s3_bucket}/mirror/rollback"))
    w = torch.randn(1 << 16)
    try:
        with ckptd.Checkpointer(local, config=_config(runtime_dir)) as ckpt:  # copies made by hand below
            ckpt.save(_sd(w, 10), step=10).wait(timeout_s=60)
            ckpt.save(_sd(w + 1, 20), step=20).wait(timeout_s=60)
            first = local_latest(local)
            mirror_step(local, first, store)  # the mirror holds the first 20
            ckpt.save(_sd(w + 2, 15), step=15).wait(timeout_s=60)  # a rollback: 15 after 20 ...
            ckpt.save(_sd(w + 3, 20), step=20).wait(timeout_s=60)  # ... and 20 again, replacing it locally
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    second = local_latest(local)
    assert second is not None and second.step == 20 and second != first
    mirror_step(local, second, store)  # the mirror lagged past 15: the copy of the replaced 20 goes
    record = read_s3_commit_record(store.client, "iter_0000020")
    assert record is not None and record.source == second.source()
    assert torch.equal(ckptd.load_plain_tensors(store.location.child("iter_0000020"))["w"], w + 3)
    with pytest.raises(CheckpointExistsError):
        mirror_step(local, second, store)  # one local commit is copied once


def test_a_mirror_must_be_an_s3_prefix_of_a_local_root(s3_bucket, runtime_dir, tmp_path):
    with pytest.raises(UnsupportedLocationError, match="a mirror is an s3://bucket/prefix"):
        ckptd.Checkpointer(tmp_path / "a", config=_config(runtime_dir, mirror=str(tmp_path / "b")))
    with pytest.raises(ckptd.CkptdError, match="second tier of a local root"):
        ckptd.Checkpointer(f"s3://{s3_bucket}/r", config=_config(runtime_dir, mirror=f"s3://{s3_bucket}/m"))


@pytest.mark.timeout(240)
def test_the_mirrored_step_stays_local_until_a_newer_one_is_mirrored(s3_bucket, runtime_dir, tmp_path):
    """keep_last=1 and a rollback: the rollback's commit (35 after 40) would retire the mirrored
    40 at once, and a crash before the mirror copied 35 would then resume from the mirror's 40,
    the abandoned branch (the local root no longer holding the mirror's commit, and 35 < 40). The
    local root's ckptd_mirrored names the step the mirror's latest copies, and retention keeps
    it until a newer one is mirrored, so a resume finds it and resumes the local, newer commit."""
    from ckptd.format.rootlayout import MIRRORED_FILE

    local = tmp_path / "local"
    cfg = _config(runtime_dir, keep_last=1, mirror=f"s3://{s3_bucket}/mirror/marker")
    marker = local / MIRRORED_FILE

    def marked(name: str) -> bool:
        return marker.exists() and marker.read_text().strip() == name

    try:
        with ckptd.Checkpointer(local, config=cfg) as ckpt:
            for step in (30, 40):
                ckpt.save(_sd(torch.full((64,), float(step)), step), step=step).wait(timeout_s=120)
                # The rollback below loads 30 from the mirror (keep_last=1 retires it locally once
                # 40 commits), and a step that a newer commit overtook before its copy started
                # is never mirrored: 40 is saved only once 30 is there.
                ckpt.wait_mirrored(step, timeout_s=120)
            wait_until(lambda: marked("iter_0000040"), 30, "the mirror thread to note step 40")
            ckpt.load(_sd(torch.zeros(64), -1), step=30)  # a rollback
            ckpt.save(_sd(torch.full((64,), 35.0), 35), step=35).wait(timeout_s=120)
            assert (local / "iter_0000040").is_dir()  # retention kept the mirror's commit
            assert not (local / "iter_0000030").exists()
            ckpt.wait_mirrored(35, timeout_s=120)
            wait_until(lambda: marked("iter_0000035"), 30, "the mirror thread to note step 35")
            ckpt.save(_sd(torch.full((64,), 36.0), 36), step=36).wait(timeout_s=120)
            assert not (local / "iter_0000040").exists()  # retired once a newer step was mirrored
    finally:
        stop_root_daemons(local, runtime_dir, timeout_s=60)
    with ckptd.Checkpointer(local, config=cfg) as ckpt:
        w = torch.zeros(64)
        assert ckpt.load(_sd(w, -1))["iteration"] == 36 and torch.equal(w, torch.full((64,), 36.0))
    stop_root_daemons(local, runtime_dir, timeout_s=60)
