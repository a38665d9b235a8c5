"""Guarantee 3 with real daemon processes: a new daemon cleans up after a crashed one (its job's
orphaned shared-memory segments and ``*.tmp`` saves, nothing else; a commit interrupted after its
rename is finished), a stale socket or pid file does not keep it from starting, and a second
daemon for the same node and job exits with 3.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.control.pidfile import daemon_alive, daemon_pid
from ckptd.daemon.main import EXIT_BUSY
from ckptd.staging.segment import SHM_DIR, ShmSegment, new_generation, segment_name
from tests.checkpoints import make_root
from tests.multiproc import without_torchrun
from tools.harness.daemons import stop_daemons
from tools.harness.ports import free_port
from tools.harness.waiting import wait_until


def _env(runtime: Path, **extra: str) -> dict[str, str]:
    env = without_torchrun(os.environ)
    env.update(CKPTD_RUNTIME_DIR=str(runtime), CKPTD_HEARTBEAT_S="0.1", CKPTD_IDLE_EXIT_S="60", **extra)
    return env


def _daemon(env: dict[str, str], root: Path, *args: str, detach: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ckptd.cli", "daemon", "--root", str(root), *args]
    return subprocess.run(cmd + (["--detach"] if detach else []), env=env, capture_output=True, text=True, timeout=60)


def _orphan_segment(name: str) -> Path:
    ShmSegment.create(name, 4096).close()  # created and never unlinked: what a crash leaves
    return SHM_DIR / name


@pytest.mark.timeout(120)
def test_new_daemon_cleans_crash_leftovers_despite_stale_socket_and_pid_file(tmp_path, runtime_dir):
    root = tmp_path / "ckpts"
    make_root(root, [5, 6], latest=5)  # iter_6: complete, renamed, but the tracker was not updated
    env = _env(runtime_dir)
    ep = Endpoints.for_job(root, JobEnv(), CkptdConfig.from_env(env))
    mine = _orphan_segment(segment_name(ep.shm_prefix, 0, new_generation(), 0))
    # Another node's: not ours to remove.
    foreign = _orphan_segment(segment_name(f"ckptd-{ep.job}-n1-", 0, new_generation(), 0))
    partial = root / "iter_0000007.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp.1a2b3c4d.part").write_bytes(b"half a data file")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(ep.socket_path))  # a socket file whose server is gone
    stale.close()
    ep.pid_path.write_text("1\n")  # a pid file naming a live, unrelated process, and not locked
    try:
        started = _daemon(env, root)
        assert started.returncode == 0, started.stderr
        assert daemon_alive(ep.pid_path) and daemon_pid(ep.pid_path) not in (None, 1)
        pid = daemon_pid(ep.pid_path)
        assert not mine.exists() and foreign.exists()
        assert not partial.exists() and (root / "iter_0000005" / "metadata.json").exists()
        # The commit a crash interrupted after its rename is finished: the job resumes from it.
        assert (root / "latest").read_text() == "iter_0000006\n"
        log = ep.log_path.read_text()
        assert "shared-memory segments left by a crashed daemon" in log and "uncommitted saves" in log
        assert "a crash had interrupted its commit" in log

        # A second daemon of this job and node exits with 3; the first one goes on.
        second = _daemon(env, root, detach=False)
        assert second.returncode == EXIT_BUSY, (second.returncode, second.stderr)
        assert daemon_pid(ep.pid_path) == pid and daemon_alive(ep.pid_path)

        # It serves a real Checkpointer (whose socket replaced the stale one).
        cfg = CkptdConfig.from_env(env)
        w = torch.arange(12.0)
        with ckptd.Checkpointer(root, config=cfg) as ckpt:
            assert ckpt.status()["pid"] == pid
            ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=8).wait(timeout_s=30)
        assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000008")["w"], w)
        stop_daemons([ep.pid_path])
        assert not ep.socket_path.exists() and not ep.pid_path.exists()
    finally:
        foreign.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_multi_node_restart_adopts_unfinished_saves_and_cleans_per_node(tmp_path, runtime_dir):
    root = tmp_path / "ckpts"
    root.mkdir()
    port = free_port()
    env = _env(runtime_dir, CKPTD_COMMIT_TIMEOUT_S="1")  # the coordinator's address given explicitly below
    cfg = CkptdConfig.from_env(env, coordinator_port=port)
    eps = [Endpoints.for_job(root, JobEnv(rank=n, world_size=2, node=n, local_world_size=1), cfg) for n in (0, 1)]
    segments = [_orphan_segment(segment_name(ep.shm_prefix, ep.node, new_generation(), 0)) for ep in eps]
    partial = root / "iter_0000003.0123456789ab-1.tmp"
    partial.mkdir()
    (partial / "__1_0.distcp").write_bytes(b"written by node 1 before the crash")
    try:
        # Node 1 first: it may clean only its own segments, and never the job's saves.
        node1 = _daemon(env, root, "--node", "1", "--nnodes", "2", "--coordinator-connect", f"tcp://127.0.0.1:{port}")
        assert node1.returncode == 0, node1.stderr
        assert not segments[1].exists() and segments[0].exists() and partial.exists()
        # The coordinator cannot know whether another node still writes into that attempt of step 3:
        # it adopts it, and once nobody completed it within the commit timeout, aborts and removes it.
        node0 = _daemon(env, root, "--node", "0", "--nnodes", "2", "--coordinator-bind", f"tcp://127.0.0.1:{port}")
        assert node0.returncode == 0, node0.stderr
        assert not segments[0].exists()
        wait_until(lambda: not partial.exists(), 20, "the adopted, abandoned save to be removed")
        assert "step 3 attempt 0123456789ab-1 aborted" in eps[0].log_path.read_text()
    finally:
        for seg in segments:
            seg.unlink(missing_ok=True)


@pytest.mark.timeout(120)
def test_a_daemon_that_exits_during_the_handshake_is_replaced(tmp_path, monkeypatch, runtime_dir):
    """An auto-started daemon may exit (idle) just as a Checkpointer connects: the HELLO then
    goes to a daemon that is gone. The Checkpointer starts a new one instead of failing. Here the
    daemon is SIGKILLed right after the Checkpointer found it alive, before its HELLO."""
    from ckptd.client import link as link_mod

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "ckpts"
    cfg = CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=5.0, heartbeat_s=0.1)
    ep = Endpoints.for_job(root, JobEnv(), cfg)
    assert _daemon(_env(runtime_dir), root).returncode == 0
    first = daemon_pid(ep.pid_path)
    real_alive = link_mod.daemon_alive
    killed: list[int] = []

    def alive_then_killed(path: Path) -> bool:
        found = real_alive(path)
        if found and not killed:
            pid = daemon_pid(path)
            os.kill(pid, signal.SIGKILL)  # the daemon goes away between the check and the HELLO
            killed.append(pid)
            wait_until(lambda: not real_alive(path), 30, "the killed daemon to let go of its lock")
        return found

    monkeypatch.setattr(link_mod, "daemon_alive", alive_then_killed)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        assert killed == [first] and ckpt.status()["pid"] not in (first, None)
        w = torch.arange(8.0)
        ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=1).wait(timeout_s=60)
        assert ckpt.latest() == 1
