"""Issue 25 H1: a step of the wall clock (NTP, a VM resumed or migrated, ``date -s``) must not
make the daemon take its live ranks for gone.

The clock is not touched: the daemon runs in a private mount namespace where ``/proc/stat`` is a
bind-mounted copy whose boot time (``btime``, which the kernel moves when the wall clock is
stepped) the test moves by a second, as a clock step does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.config import CkptdConfig
from ckptd.control.endpoints import Endpoints, JobEnv
from tests.fault.test_restart_recovery import _env

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")


def _move_btime(stat_copy: Path, by_s: int) -> None:
    text = stat_copy.read_text()
    btime = int(re.search(r"^btime (\d+)$", text, re.M).group(1))
    stat_copy.write_text(re.sub(r"^btime \d+$", f"btime {btime + by_s}", text, flags=re.M))


@pytest.mark.timeout(120)
def test_wall_clock_step_keeps_live_ranks_saving(tmp_path, runtime_dir):
    root = tmp_path / "ckpts"
    root.mkdir()
    stat_copy = tmp_path / "stat"
    stat_copy.write_bytes(Path("/proc/stat").read_bytes())
    env = {**_env(runtime_dir), "CKPTD_HEARTBEAT_S": "0.05"}
    ep = Endpoints.for_job(root, JobEnv(), CkptdConfig.from_env(env))
    daemon = f'mount --bind {stat_copy} /proc/stat && exec "$0" -m ckptd.cli daemon --root {root} --detach'
    started = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", daemon, sys.executable],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if started.returncode != 0 and "unshare" in started.stderr:
        pytest.skip(f"no private mount namespace here: {started.stderr.strip()}")
    assert started.returncode == 0, started.stderr
    w = torch.arange(16.0)
    sd = {"w": ShardedTensor.from_rank_offsets("w", w)}
    with ckptd.Checkpointer(root, config=CkptdConfig.from_env(env)) as ckpt:
        ckpt.save(sd, step=1).wait(timeout_s=30)
        _move_btime(stat_copy, 1)  # the wall clock was stepped forward by a second
        time.sleep(0.5)  # ten heartbeats: the daemon checks its ranks at each
        w.add_(1)
        ckpt.save(sd, step=2).wait(timeout_s=30)
        _move_btime(stat_copy, -2)
        time.sleep(0.5)
        w.add_(1)
        ckpt.save(sd, step=3).wait(timeout_s=30)
        assert ckpt.latest() == 3
    assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000003")["w"], w)
    assert "is gone" not in ep.log_path.read_text()


@pytest.mark.timeout(120)
def test_a_rank_the_daemon_forgot_registers_again_and_saves(tmp_path, single_process, caplog, runtime_dir):
    """Whatever made the daemon forget a live rank (here: a BYE the rank did not mean), the rank's
    next save says HELLO again, registers a new ring and commits; saves in flight still resolve."""
    from ckptd.control.protocol import Bye

    root = tmp_path / "ckpts"
    w = torch.arange(16.0)
    sd = {"w": ShardedTensor.from_rank_offsets("w", w)}
    with ckptd.Checkpointer(root, config=CkptdConfig.from_env(_env(runtime_dir))) as ckpt:
        first = ckpt.save(sd, step=1)
        ckpt._link.send(Bye())  # the daemon drops the client and retires its ring
        w.add_(1)
        second = ckpt.save(sd, step=2)
        assert first.wait(timeout_s=30) and second.wait(timeout_s=30)
    assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000002")["w"], w)
    assert "registering with the node daemon again" in caplog.text


@pytest.mark.timeout(120)
def test_a_rank_the_daemon_forgot_prepares_again(tmp_path, single_process, caplog, runtime_dir):
    """prepare() of a rank the daemon forgot registers again, as a save does (it raised before)."""
    from ckptd.control.protocol import Bye

    root = tmp_path / "ckpts"
    w = torch.arange(16.0)
    sd = {"w": ShardedTensor.from_rank_offsets("w", w)}
    with ckptd.Checkpointer(root, config=CkptdConfig.from_env(_env(runtime_dir))) as ckpt:
        ckpt.prepare(sd)
        ckpt._link.send(Bye())
        sd["v"] = ShardedTensor.from_rank_offsets("v", torch.ones(8))
        ckpt.prepare(sd)  # a new layout to register
        ckpt.save(sd, step=1).wait(timeout_s=30)
    assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000001")["w"], w)
    assert "registering with the node daemon again" in caplog.text
