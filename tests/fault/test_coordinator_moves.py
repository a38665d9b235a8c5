"""A relaunch whose coordinator address changed (another MASTER_PORT: torch elastic without the
shared agent store picks one per round, some SLURM scripts too; another MASTER_ADDR: the node that
was node 0 was replaced) still commits, whichever node daemon outlived the first launch.

Each rank's HELLO names the coordinator address its launch has (ckptd.control.protocol.Hello):
node 0's daemon left by the earlier launch listens there too, another node's connects there
instead. Before, the saves of such a relaunch aborted after ``coordinator_timeout_s``: the node
daemon the relaunch started and the one the first launch left talked to different ports.

Real trainers (two gloo ranks, a node each), real node daemons, one of which is SIGKILLed between
the launches; single-process checks of the refusals.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptd
from tests.fault.test_resume_in_flight import _as_node, _sd, _values
from tests.multiproc import without_torchrun
from tools.harness.ports import free_port
from tools.harness.ranks import run_ranks
from tools.harness.waiting import wait_until


def _first_launch(rank: int, world_size: int, root: str, runtime: str, port: int) -> int:
    """Commit step 5 with the coordinator on ``port``; this node daemon's pid."""
    cfg = _as_node(rank, port, runtime_dir=runtime, idle_exit_s=120.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        ckpt.save(_sd(_values(5, rank), rank, world_size), step=5).wait(timeout_s=60)
        return int(ckpt.status()["pid"])


def _relaunch(rank: int, world_size: int, root: str, runtime: str, port: int) -> tuple[int, int, dict]:
    """Resume, save step 10 with the coordinator on ``port``: the step resumed, the step committed
    last, and this node daemon's status."""
    # A short coordinator timeout: without following the new address, step 10 aborts within seconds.
    cfg = _as_node(rank, port, runtime_dir=runtime, coordinator_timeout_s=5.0, idle_exit_s=120.0)
    with ckptd.Checkpointer(root, config=cfg) as ckpt:
        out = ckpt.resume(_sd(torch.zeros(256), rank, world_size))
        assert out is not None and torch.equal(out["w"], _values(5, rank))
        ckpt.save(_sd(_values(10, rank), rank, world_size), step=10).wait(timeout_s=60)
        return int(out["w"][0].item()) // 100, ckpt.latest(), ckpt.status()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("survivor", [0, 1], ids=["node-0-daemon-outlives", "node-1-daemon-outlives"])
def test_a_relaunch_on_another_port_commits_with_the_node_daemon_an_earlier_launch_left(
    tmp_path, runtime_dir, survivor
):
    root, runtime = str(tmp_path / "run"), str(runtime_dir)
    first_port, second_port = free_port(), free_port()
    pids = run_ranks(_first_launch, 2, root, runtime, first_port, timeout_s=90)
    doomed = pids[1 - survivor]
    os.kill(doomed, signal.SIGKILL)
    wait_until(lambda: not os.path.exists(f"/proc/{doomed}"), 10, f"daemon {doomed} to exit")

    outcomes = run_ranks(_relaunch, 2, root, runtime, second_port, timeout_s=120)

    assert [o[:2] for o in outcomes] == [(5, 10), (5, 10)], outcomes
    status0, status1 = outcomes[0][2], outcomes[1][2]
    assert status0["pid"] == pids[0] if survivor == 0 else status0["pid"] != pids[0]
    assert status1["pid"] == pids[1] if survivor == 1 else status1["pid"] != pids[1]
    coordinator = status0["coordinator"]
    if survivor == 0:  # the old coordinator listens on the new port too
        assert coordinator["address"].endswith(f":{first_port}"), coordinator
        assert [a.rsplit(":", 1)[1] for a in coordinator["also_listening_on"]] == [str(second_port)]
    else:  # node 1's old daemon connects to the new coordinator
        assert coordinator["address"].endswith(f":{second_port}") and not coordinator["also_listening_on"]
    assert status1["upstream"]["address"].endswith(f":{second_port}")


@pytest.mark.timeout(120)
def test_a_coordinator_port_another_process_holds_is_refused_clearly_and_a_newer_launch_is_followed(
    tmp_path, single_process, runtime_dir
):
    """Node 0's daemon cannot listen on the new launch's port (another process holds it): the new
    Checkpointer fails at once, saying what to do, rather than every save aborting later. A newer
    launch is followed while a process of the earlier one still runs (most likely a rank not
    reaped yet), with a warning in the daemon's log; both addresses then reach the coordinator."""
    root = tmp_path / "run"
    first, taken, third = free_port(), free_port(), free_port()
    config = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=60.0)
    with ckptd.Checkpointer(root, config=config.replace(coordinator_port=first)) as running:
        running.save(_sd(_values(5)), step=5).wait(timeout_s=60)
        with (
            socket.create_server(("127.0.0.1", taken)),
            pytest.raises(
                ckptd.CkptdError, match=f"cannot listen on tcp://127.0.0.1:{taken} too.*CKPTD_COORDINATOR_PORT"
            ),
        ):
            ckptd.Checkpointer(root, config=config.replace(coordinator_port=taken))
        with ckptd.Checkpointer(root, config=config.replace(coordinator_port=third)) as relaunched:
            assert relaunched.status()["coordinator"]["also_listening_on"] == [f"tcp://127.0.0.1:{third}"]
            relaunched.save(_sd(_values(10)), step=10).wait(timeout_s=60)
            running.save(_sd(_values(15)), step=15).wait(timeout_s=60)  # its address still works
            assert relaunched.latest() == 15
            log = relaunched.endpoints.log_path.read_text()
            assert f"has the coordinator at tcp://127.0.0.1:{first}, still runs" in log


_NODE_1 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"}
_NEWER_LAUNCH = textwrap.dedent(
    """
    import sys
    import ckptd
    root, runtime, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=60.0, coordinator_port=port)
    with ckptd.Checkpointer(root, config=cfg):
        print("connected", flush=True)
        sys.stdin.readline()  # until the test is done
    """
)


@pytest.mark.timeout(120)
def test_a_hello_from_a_process_older_than_the_followed_launch_does_not_take_the_daemon_back(
    tmp_path, single_process, runtime_dir, monkeypatch
):
    """Node 1's daemon follows the relaunch's coordinator address; a rank of an earlier launch that
    says HELLO again (a reconnect) after the relaunch's ranks did must not move it back: only a
    process started later is followed. (Node 0's coordinator listens on every launch's address.)"""
    root, newer_port, older_port = tmp_path / "run", free_port(), free_port()
    env = {**without_torchrun(os.environ), **_NODE_1, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    newer = subprocess.Popen(
        [sys.executable, "-c", _NEWER_LAUNCH, str(root), str(runtime_dir), str(newer_port)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert newer.stdout is not None and newer.stdout.readline().strip() == "connected"
        for name, value in env.items():
            if name in _NODE_1 or name.startswith("MASTER_"):
                monkeypatch.setenv(name, value)
        config = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), coordinator_port=older_port)
        with ckptd.Checkpointer(root, config=config) as older:  # this process started before the other
            status = older.status()
            assert status["node"] == 1 and status["upstream"]["address"].endswith(f":{newer_port}")
            assert "a process started after it has another: not followed" in older.endpoints.log_path.read_text()
    finally:
        newer.communicate("\n", timeout=60)
