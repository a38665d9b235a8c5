"""The check a resume makes of an ``s3://`` checkpoint before it chooses it
(ckptd.recovery.structural_problem), against a real server (SeaweedFS): a data object of the
latest commit that is gone or of another size is damage the resume falls back past, with a
warning naming the object; a store that fails the check's listing is an error, never damage."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd.errors import CorruptCheckpointError, StorageError
from ckptd.recovery import resolve_latest
from ckptd.storage.s3client import S3Client
from ckptd.storage.url import parse_location
from tests.multiproc import without_torchrun
from tests.objstore.test_s3_roots import _commit_steps_1_and_2 as commit_steps_1_and_2
from tests.objstore.test_s3_roots import _config, _sd
from tools.harness.daemons import stop_root_daemons


def _commit_steps_1_and_2(root: str, runtime_dir: Path) -> str:
    """Steps 1 and 2 committed on ``root`` (:func:`tests.objstore.test_s3_roots._commit_steps_1_and_2`);
    returns the key of step 2's data object."""
    commit_steps_1_and_2(root, runtime_dir)
    client = S3Client(parse_location(root))
    (data,) = [i.key for i in client.list_objects("iter_0000002") if i.key.endswith(".distcp")]
    return data


@pytest.mark.timeout(180)
def test_a_lost_data_object_of_the_latest_is_damage_a_resume_falls_back_past(s3_bucket, runtime_dir, caplog):
    """The check took the sizes of the data objects from the commit record and never asked the
    store: latest() said 2, and only the load that followed found the object gone. It lists the
    step's objects now (one request), as a directory's check looks at its data files."""
    root = f"s3://{s3_bucket}/lost"
    data = _commit_steps_1_and_2(root, runtime_dir)
    S3Client(parse_location(root)).delete([data])
    url = f"{root}/{data}"
    caplog.set_level(logging.WARNING, logger="ckptd.recovery")
    try:
        with ckptd.Checkpointer(root, config=_config(runtime_dir)) as ckpt:
            assert ckpt.latest() == 1  # before: 2
            warned = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
            assert warned and all(
                f"names iter_0000002, which is damaged: data object {url} is missing" in m
                and "resuming from the newest valid committed checkpoint iter_0000001" in m
                for m in warned
            ), warned
            w = torch.zeros(64)
            assert ckpt.resume(_sd(w, -1))["iteration"] == 1
            assert torch.equal(w, torch.full((64,), 1.0))
            with pytest.raises(CorruptCheckpointError, match=f"data object {url} is missing"):
                ckpt.load(_sd(torch.zeros(64), -1), step=2)
    finally:
        stop_root_daemons(root, runtime_dir, timeout_s=60)
    run = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "verify", f"{root}/iter_0000002"],
        env={**without_torchrun(os.environ), "CKPTD_RUNTIME_DIR": str(runtime_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1 and f"data object {url} is missing" in run.stdout + run.stderr, run


@pytest.mark.timeout(120)
def test_a_data_object_of_another_size_than_committed_is_damage(s3_bucket, runtime_dir):
    root = f"s3://{s3_bucket}/short"
    data = _commit_steps_1_and_2(root, runtime_dir)
    client = S3Client(parse_location(root))
    got = client.get(data, 1 << 20)
    assert got is not None
    committed = len(got[0])
    client.put(data, got[0][: committed // 2])  # cut short, as a store's damage or a hand's copy
    choice = resolve_latest(root)
    assert choice is not None and choice.step == 1  # before: 2
    found = f"data object {root}/{data} has {committed // 2} bytes, {committed} committed"
    assert choice.skipped == (("iter_0000002", found),)


@pytest.mark.timeout(120)
def test_a_store_failing_the_check_s_listing_is_an_error_not_damage(s3_bucket, runtime_dir, monkeypatch):
    """The listing failing for good (the store down past its retries) says so; read as a missing
    object it would resume an older step, and the next commit would leave the newer ones to
    retention as an abandoned branch."""
    root = f"s3://{s3_bucket}/outage"
    _commit_steps_1_and_2(root, runtime_dir)
    list_dir = S3Client.list_dir

    def failing_list_dir(self, prefix=""):
        if self.url(prefix).rstrip("/") == f"{root}/iter_0000002":
            raise StorageError(f"could not list {self.url(prefix)}: 503 Slow Down (tries exhausted)")
        return list_dir(self, prefix)

    monkeypatch.setattr(S3Client, "list_dir", failing_list_dir)
    with pytest.raises(StorageError, match="503 Slow Down"):
        resolve_latest(root)
    monkeypatch.setattr(S3Client, "list_dir", list_dir)
    choice = resolve_latest(root)
    assert choice is not None and choice.step == 2 and choice.fallback_reason is None
