"""The local host with real daemons: a client never talks to a daemon it cannot trust to be its
own user's, and a daemon cleans up only its own job's shared memory.

- With CKPTD_JOB_TOKEN set (no token file needed), a Checkpointer whose runtime directory belongs
  to another user, or whose pid file and socket do, refuses before sending anything to the
  (fake, test-run) daemon listening there.
- A daemon of job ``llama`` starts although an empty file of another user carries its shared
  memory prefix, and removes neither it nor job ``llama-n0``'s segments.

Other users are simulated by chowning real files to uid 65534 (the tests run as root).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
import zmq

import ckptd
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv, ensure_private_dir
from ckptd.errors import DaemonError
from ckptd.staging.segment import SHM_DIR, ShmSegment, new_generation, segment_name
from tests.fault.test_restart_recovery import _daemon, _env, _stop

OTHER_UID = 65534


class FakeDaemon:
    """What another user could run in a shared runtime directory: a held pid-file lock and a
    ROUTER socket at the job's ipc path, both owned by that user. Counts what it receives."""

    def __init__(self, ep: Endpoints) -> None:
        self.lock_fd = os.open(ep.pid_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        os.write(self.lock_fd, f"{os.getpid()}\n".encode())
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(ep.ipc_address)
        for path in (ep.pid_path, ep.socket_path):
            os.chown(path, OTHER_UID, OTHER_UID)

    def received(self) -> int:
        n = 0
        while self.sock.poll(200):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        os.close(self.lock_fd)


@pytest.fixture
def runtime() -> Path:
    path = Path(tempfile.mkdtemp(prefix="ckt", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("owned_by_other", ["runtime directory", "pid file and socket"])
def test_a_client_with_a_job_token_never_talks_to_another_users_daemon(
    tmp_path, runtime, owned_by_other, single_process
):
    cfg = CkptdConfig.from_env(
        {}, runtime_dir=str(runtime), job_token=secrets.token_hex(32), request_timeout_s=3.0, daemon_start_timeout_s=5.0
    )
    ep = Endpoints.for_job(tmp_path / "root", JobEnv(), cfg)
    fake = FakeDaemon(ep)
    if owned_by_other == "runtime directory":
        os.chown(runtime, OTHER_UID, OTHER_UID)
    try:
        with pytest.raises(DaemonError, match=f"owned by uid {OTHER_UID}") as err:
            ckptd.Checkpointer(tmp_path / "root", config=cfg)
        assert str(runtime if owned_by_other == "runtime directory" else ep.pid_path) in str(err.value)
        assert fake.received() == 0, "the client sent its HELLO to another user's daemon"
    finally:
        fake.close()


@pytest.mark.timeout(120)
def test_a_daemon_starts_despite_a_foreign_file_and_cleans_only_its_own_segments(tmp_path, runtime):
    job = f"llama{secrets.token_hex(3)}"
    env = _env(runtime, CKPTD_JOB_ID=job)
    ep = Endpoints.for_job(tmp_path / "root", JobEnv(), CkptdConfig.from_env(env))
    ensure_private_dir(runtime)
    mine = SHM_DIR / segment_name(ep.shm_prefix, 0, new_generation(), 0)  # a crashed rank's
    ShmSegment.create(mine.name, 4096).close()
    neighbour = SHM_DIR / segment_name(f"ckptd-{job}-n0-n0-", 0, new_generation(), 0)  # job "<job>-n0"
    ShmSegment.create(neighbour.name, 4096).close()
    foreign = SHM_DIR / segment_name(ep.shm_prefix, 1, new_generation(), 0)
    foreign.write_bytes(b"")
    os.chown(foreign, OTHER_UID, OTHER_UID)
    try:
        started = _daemon(env, tmp_path / "root")
        assert started.returncode == 0, started.stderr
        assert not mine.exists() and neighbour.exists() and foreign.exists()
        assert "not regular files of this user" in ep.log_path.read_text()
    finally:
        _stop(ep)
        for path in (mine, neighbour, foreign):
            path.unlink(missing_ok=True)
