"""Issue 25 M8: a second job on one checkpoint root (the same job launched twice, with its own
runtime directory and token) is refused with a clear error instead of removing the first job's
saves in flight and shared memory; a crashed job's lock never blocks its restart."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

import ckptd
from ckptd import ShardedTensor
from ckptd.control.endpoints import Endpoints, JobEnv
from ckptd.errors import DaemonError
from ckptd.staging.segment import SHM_DIR
from tools.harness.daemons import private_runtime_dir
from tools.harness.waiting import wait_for_exit


def _config(runtime_dir: Path, **kw) -> ckptd.CkptdConfig:
    return ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0, heartbeat_s=0.1, **kw)


def _segments(cfg: ckptd.CkptdConfig, root) -> list[str]:
    prefix = Endpoints.for_job(root, JobEnv(), cfg).shm_prefix
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


@pytest.mark.timeout(120)
def test_a_second_job_on_a_root_is_refused_and_the_first_goes_on(tmp_path, single_process, runtime_dir):
    # Three launches, each with its own runtime directory, made and checked as runtime_dir is.
    with (
        private_runtime_dir(tmp_path / "daemon-logs-2") as second,
        private_runtime_dir(tmp_path / "daemon-logs-3") as third,
    ):
        _second_job_refused_first_goes_on(tmp_path / "run", runtime_dir, second, third)


def _second_job_refused_first_goes_on(root: Path, *runtime_dirs: Path) -> None:
    first_cfg = _config(runtime_dirs[0], debug_write_delay_s=2.0)
    w = torch.arange(4096.0)
    with ckptd.Checkpointer(root, config=first_cfg) as first:
        in_flight = first.save({"w": ShardedTensor.from_rank_offsets("w", w)}, step=1)
        rings = _segments(first_cfg, root)
        assert rings
        with pytest.raises(
            DaemonError, match=r"another ckptd daemon \(pid \d+ on .*serves node 0 of the checkpoint root"
        ):
            ckptd.Checkpointer(root, config=_config(runtime_dirs[1]))
        # The first job's ring and its save in flight were left alone: the save commits.
        assert _segments(first_cfg, root) == rings
        in_flight.wait(timeout_s=30)
        assert first.latest() == 1
        daemon = first.status()["pid"]
        # Its daemon crashes: the lock goes with it, and the next launch (any runtime directory) starts.
        os.kill(daemon, signal.SIGKILL)
        wait_for_exit(daemon, 30, "the killed daemon to exit")
    second_cfg = _config(runtime_dirs[2])
    with ckptd.Checkpointer(root, config=second_cfg) as second:
        assert second.latest() == 1
        second.save({"w": ShardedTensor.from_rank_offsets("w", w + 1)}, step=2).wait(timeout_s=30)
    assert torch.equal(ckptd.load_plain_tensors(root / "iter_0000002")["w"], w + 1)
