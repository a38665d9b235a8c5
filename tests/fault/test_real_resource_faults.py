"""Guarantee 4 with real resource failures, where this machine allows them (else skipped, with the
reason; tests/fault/test_resource_faults.py covers the same handling with injected faults):

- a full disk and a read-only filesystem: a small tmpfs, filled up, then remounted read-only
  (needs root and mount(2));
- permission denied: the checkpoint root made read-only with chmod. Root ignores file modes, so as
  root the scenario runs in a child process without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH in its
  bounding set: the daemon it starts is denied like any user.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import traceback
from pathlib import Path

import pytest

from tests.fault.single_job import loads_bit_exact, single_job, tmp_leftovers
from tools.harness.ranks import spawn_queue, spawned

PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    r = _run("mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mnt))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        _run("umount", "-l", str(mnt))


@pytest.mark.timeout(90)
def test_real_full_disk_then_read_only_filesystem(tmpfs, tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch, root=tmpfs / "ckpts") as job:
        job.committed(1)
        st = os.statvfs(tmpfs)
        ballast = tmpfs / "ballast"
        ballast.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 8192))  # two pages left
        err = job.failed(2)
        assert "No space left on device" in err, err
        ballast.unlink()
        loads_bit_exact(job.ckpt, 1)
        job.committed(2)

        r = _run("mount", "-o", "remount,ro", str(tmpfs))
        assert r.returncode == 0, r.stderr
        try:
            err = job.failed(3)
            assert "Read-only file system" in err, err
            loads_bit_exact(job.ckpt, 2)
        finally:
            _run("mount", "-o", "remount,rw", str(tmpfs))
        job.committed(4)
        loads_bit_exact(job.ckpt, 1)
        assert job.ckpt.latest() == 4 and not tmp_leftovers(job.root)


@pytest.mark.timeout(90)
def test_real_full_disk_during_the_commit_names_the_file(tmpfs, tmp_path, monkeypatch):
    """The disk fills up after the data file was written: the commit's error names the file it
    was writing (write(2) names none; the error used to name the root)."""
    with single_job(tmp_path, monkeypatch, root=tmpfs / "ckpts") as job:
        job.committed(1)
        data_nbytes = os.lstat(job.root / "iter_0000001" / "__0_0.distcp").st_blocks * 512
        st = os.statvfs(tmpfs)
        (tmpfs / "ballast").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - data_nbytes))  # room for it only
        err = job.failed(2)
        where = rf"{re.escape(str(job.root))}/iter_0000002\.[0-9a-f]{{12}}-\d+\.tmp/common\.pt\.tmp: No space left"
        assert re.search(where, err), err
        (tmpfs / "ballast").unlink()
        job.committed(2)
        loads_bit_exact(job.ckpt, 1)


def _drop_dac_capabilities() -> None:
    """Remove the capabilities that let root ignore file modes from every program exec'd later."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise PermissionError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap}) failed")


def _permission_scenario(tmp: str, queue: mp.Queue) -> None:
    try:
        if os.geteuid() == 0:
            try:
                _drop_dac_capabilities()
            except PermissionError as exc:
                queue.put(("skip", f"cannot drop CAP_DAC_OVERRIDE: {exc}"))
                return
        with pytest.MonkeyPatch.context() as mpatch, single_job(Path(tmp), mpatch) as job:
            job.committed(1)
            os.chmod(job.root, 0o555)
            try:
                err = job.failed(2)
            finally:
                os.chmod(job.root, 0o755)
            loads_bit_exact(job.ckpt, 1)
            job.committed(2)
            assert job.ckpt.latest() == 2
        queue.put(("ok", err))
    except BaseException:  # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))


@pytest.mark.timeout(120)
def test_real_permission_denied(tmp_path):
    queue = spawn_queue()
    with spawned([(_permission_scenario, (str(tmp_path), queue))], join_timeout_s=30):
        kind, detail = queue.get(timeout=100)
    if kind == "skip":
        pytest.skip(detail)
    assert kind == "ok", detail
    assert "Permission denied" in detail and "iter_0000002." in detail and ".tmp" in detail, detail
