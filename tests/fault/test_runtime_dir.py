"""The local host with real daemons: a client never talks to a daemon it cannot trust to be its
own user's, and a daemon cleans up only its own job's shared memory.

- With CKPTD_JOB_TOKEN set (no token file needed), a Checkpointer whose runtime directory belongs
  to another user, or whose pid file and socket do, refuses before sending anything to the
  (fake, test-run) daemon listening there.
- A daemon of job ``llama`` starts although an empty file of another user carries its shared
  memory prefix, and removes neither it nor job ``llama-n0``'s segments.
- With no runtime directory configured, another user who created ``/tmp/ckptd-<uid>`` first (and
  a decoy fallback of theirs) no longer stops this user's jobs: they meet in an unpredictable
  ``/tmp/ckptd-<uid>-<random>`` of this user, ranks starting together agree on it, and a restarted
  trainer finds its daemon there. This runs in a private mount namespace with its own ``/tmp``
  (the machine's ``/tmp/ckptd-<uid>`` belongs to other tests).

Other users are simulated by chowning real files to uid 65534 (the tests run as root).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import zmq

import ckptd
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.errors import DaemonError
from ckptd.staging.segment import SHM_DIR, ShmSegment, new_generation, segment_name
from tests.fault.test_restart_recovery import _daemon, _env
from tests.multiproc import without_torchrun

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
def foreign_runtime() -> Path:
    """A runtime directory whose pid file and socket, or the directory itself, become another
    user's: no daemon of this user runs there, and the ``runtime_dir`` fixture, as every client,
    refuses to touch another user's pid file."""
    path = Path(tempfile.mkdtemp(prefix="ck", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("owned_by_other", ["runtime directory", "pid file and socket"])
def test_a_client_with_a_job_token_never_talks_to_another_users_daemon(
    tmp_path, foreign_runtime, owned_by_other, single_process
):
    cfg = CkptdConfig.from_env(
        {},
        runtime_dir=str(foreign_runtime),
        job_token=secrets.token_hex(32),
        request_timeout_s=3.0,
        daemon_start_timeout_s=5.0,
    )
    ep = Endpoints.for_job(tmp_path / "root", JobEnv(), cfg)
    fake = FakeDaemon(ep)
    if owned_by_other == "runtime directory":
        os.chown(foreign_runtime, OTHER_UID, OTHER_UID)
    try:
        with pytest.raises(DaemonError, match=f"owned by uid {OTHER_UID}") as err:
            ckptd.Checkpointer(tmp_path / "root", config=cfg)
        assert str(foreign_runtime if owned_by_other == "runtime directory" else ep.pid_path) in str(err.value)
        assert fake.received() == 0, "the client sent its HELLO to another user's daemon"
    finally:
        fake.close()


@pytest.mark.timeout(120)
def test_a_daemon_starts_despite_a_foreign_file_and_cleans_only_its_own_segments(tmp_path, runtime_dir):
    job = f"llama{secrets.token_hex(3)}"
    env = _env(runtime_dir, CKPTD_JOB_ID=job)
    ep = Endpoints.for_job(tmp_path / "root", JobEnv(), CkptdConfig.from_env(env))
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
        for path in (mine, neighbour, foreign):
            path.unlink(missing_ok=True)


# Run inside the namespace; prints one JSON line, in one write(2) (six of them print at once into
# one pipe: print() may reach it in two writes, and lines came out interleaved). "resolve": the
# runtime directory and token a process finds; "train": a trainer that saves a step and leaves
# (its daemon stays); "stop".
_CHILD = """
import json, os, sys
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv, load_token
what, root = sys.argv[1], sys.argv[2]
cfg = CkptdConfig.from_env()
ep = Endpoints.for_job(root, JobEnv(), cfg)
out = {"runtime_dir": str(ep.runtime_dir)}
if what == "resolve":
    out["token"] = load_token(ep, cfg).decode()
elif what == "train":  # torch only here: six resolving processes importing it cost 18 CPU-s
    import torch
    import ckptd
    step = int(sys.argv[3])
    ckpt = ckptd.Checkpointer(root, config=cfg)
    w = torch.full((16,), float(step))
    ckpt.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", w)}, step=step).wait(60)
    out.update(latest=ckpt.latest(), daemon=ckpt.status()["pid"])
    ckpt.close()
os.write(1, (json.dumps(out) + "\\n").encode())
"""

_SCRIPT = """
set -e
exec 9< "$REPO"  # the checkout may live under /tmp (a CI clone): keep it reachable past the mount
# (--no-canonicalize: mount(8) would resolve fd 9 to its path, which the new /tmp hides)
mount -t tmpfs -o mode=1777 tmpfs /tmp
case "$REPO" in /tmp/*) mkdir -p "$REPO" && mount --no-canonicalize --bind /proc/self/fd/9 "$REPO";; esac
mkdir -m 0755 /tmp/ckptd-0 && chown 65534:65534 /tmp/ckptd-0        # there first
mkdir -m 0700 /tmp/ckptd-0-0decoy && chown 65534:65534 /tmp/ckptd-0-0decoy
echo '#concurrent'
for i in 1 2 3 4 5 6; do python -c "$CHILD" resolve /tmp/job/ckpts & done; wait
echo '#trainers'
python -c "$CHILD" train /tmp/job/ckpts 1
python -c "$CHILD" train /tmp/job/ckpts 2
python -m ckptd.cli daemon stop --root /tmp/job/ckpts >&2
echo '#dirs'
for d in /tmp/ckptd-0*; do echo "$(stat -c '%U %a' $d) $d"; done
"""


@pytest.mark.timeout(180)
def test_a_squatted_default_runtime_dir_does_not_stop_the_users_jobs():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a private /tmp needs root and unshare(1)")
    env = without_torchrun(os.environ)
    for var in ("XDG_RUNTIME_DIR", "CKPTD_RUNTIME_DIR"):
        env.pop(var, None)
    env.update(CHILD=_CHILD, CKPTD_HEARTBEAT_S="0.1", CKPTD_IDLE_EXIT_S="60")
    repo = str(Path(__file__).resolve().parents[2])
    env["REPO"] = repo
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    run = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", _SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    if run.returncode != 0 and "mount" in run.stderr and "ckptd" not in run.stderr:
        pytest.skip(f"cannot mount a private /tmp here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr[-3000:]
    parts = run.stdout.split("#")
    concurrent = [json.loads(line) for line in parts[1].splitlines()[1:] if line.strip()]
    trainers = [json.loads(line) for line in parts[2].splitlines()[1:] if line.strip()]
    dirs = [line.split() for line in parts[3].splitlines()[1:] if line.strip()]
    # Ranks starting together meet in one directory of this user, with one token.
    assert len(concurrent) == 6 and len({(c["runtime_dir"], c["token"]) for c in concurrent}) == 1, concurrent
    mine = concurrent[0]["runtime_dir"]
    assert mine.startswith("/tmp/ckptd-0-") and mine != "/tmp/ckptd-0-0decoy"
    assert ["root", "700", mine] in dirs and ["nobody", "755", "/tmp/ckptd-0"] in dirs, dirs
    assert len([d for d in dirs if d[0] == "root"]) == 1, dirs  # no stray fallback left
    # A restarted trainer finds the daemon its predecessor left running, and resumes.
    first, second = trainers
    assert first["runtime_dir"] == second["runtime_dir"] == mine
    assert first["latest"] == 1 and second["latest"] == 2 and first["daemon"] == second["daemon"]
