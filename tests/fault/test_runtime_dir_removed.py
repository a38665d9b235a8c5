"""A runtime directory removed under a running job (logind removes ``$XDG_RUNTIME_DIR`` at the
user's last logout, a ``/tmp`` cleaner removes ``/tmp/ckptd-<uid>``), with a real Checkpointer in
the test process and its real daemon.

The rank judges its daemon by the process it handshook with, not by the pid file: its connection
stays, and its next saves commit through the same daemon. Before, the missing pid file made it
take the daemon for dead: it failed its pending saves and launched a replacement, which the live
daemon's root lock refused, so every later save failed until that daemon exited idle.

The daemon puts back what vanished at its next heartbeat (ckptd.daemon.runfiles): the directory
(0700), its log, token, pid file and socket, so that new processes (``ckptd status``, a restarted
trainer) find it again; so are those files alone, removed by a cleaner of old files. A directory
whose parent went too is not made again until the parent is back.
"""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from ckptd.client.admin import daemon_status, local_daemons
from ckptd.control.pidfile import daemon_alive, daemon_pid
from tests.fault.single_job import SingleJob, single_job
from tools.harness.waiting import wait_until


def _found_again(job: SingleJob, pid: int) -> None:
    """The daemon ``pid`` is findable as a new process finds it: pid file, socket and token."""
    ep = job.ckpt.endpoints
    wait_until(lambda: daemon_alive(ep.pid_path), 30, f"the daemon to put back {ep.pid_path}")
    assert daemon_pid(ep.pid_path) == pid
    wait_until(lambda: ep.socket_path.exists(), 30, f"the daemon to bind {ep.socket_path} again")
    assert stat.S_IMODE(os.stat(ep.runtime_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(ep.socket_path).st_mode) == 0o600
    found = local_daemons(job.root, job.config)
    assert [(d.node, d.pid) for d in found] == [(0, pid)]
    assert daemon_status(found[0], job.config)["pid"] == pid  # over the socket, with the token
    assert "was removed under this daemon" in job.daemon_log()  # the log goes on in a new file


@pytest.mark.timeout(120)
def test_a_removed_runtime_dir_keeps_the_job_saving_and_is_put_back(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch) as job:
        job.committed(1)
        pid = job.daemon_pid
        shutil.rmtree(job.ckpt.endpoints.runtime_dir)
        job.committed(2)  # at once: the daemon may not have put anything back yet
        _found_again(job, pid)
        job.committed(3)
        ep = job.ckpt.endpoints
        for old in (ep.socket_path, ep.pid_path, ep.token_path, ep.log_path):  # a cleaner of old files
            old.unlink()
        job.committed(4)
        _found_again(job, pid)
        assert job.ckpt.status()["pid"] == pid


@pytest.mark.timeout(120)
def test_a_runtime_dir_removed_with_its_parent_is_put_back_once_the_parent_is(tmp_path, monkeypatch, runtime_dir):
    parent = runtime_dir / "xdg"
    parent.mkdir(mode=0o700)
    with single_job(tmp_path, monkeypatch, runtime_dir=str(parent / "ckptd")) as job:
        job.committed(1)
        pid = job.daemon_pid
        shutil.rmtree(parent)  # what logind does to $XDG_RUNTIME_DIR at the last logout
        job.committed(2)
        job.committed(3)
        assert not parent.exists(), "the daemon made a parent of its runtime directory again"
        parent.mkdir(mode=0o700)  # the next login
        _found_again(job, pid)
        assert "is whole again" in job.daemon_log()
        job.committed(4)
