"""``ckptd bench train``'s DCP modes start DCP's checkpoint process before the timed loop (as
ckptd's daemon is started before the ranks), and write with the thread count they are given.

One rank in its own interpreter (a gloo group of one): DCP's PROCESS executor spawns its
checkpoint process at the first ``async_save``, which must not be a timed one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.harness.ports import free_port

RANK = r"""
import json, sys, time
from pathlib import Path
import torch.distributed as dist
from torch.distributed.checkpoint import _async_process_executor as executor
from benchmarks.harness import Rank, stop_dcp_process
from benchmarks.train import flat_workload
from benchmarks.trainloop import DcpSaver

base = Path(sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
out = {}
try:
    r = Rank(0, 1, {"name": "main", "dir": str(base), "phase_file": str(base / "phase"), "dcp_thread_count": 2})
    w = flat_workload(0, 4 << 20, 8)
    out["process_before"] = executor._CHECKPOINT_PROCESS is not None
    saver = DcpSaver(r, w, "dcp_async_process")
    out["process_after_init"] = executor._CHECKPOINT_PROCESS is not None
    out["warm_dir_left"] = (base / "dcp-dcp_async_process" / "warm").exists()
    out["fence_s"] = saver.fence_s
    saver.save({"t": w.state(0)["r0.t00000"].data}, 1)
    saver.finish()
    saver.close()
    out["files"] = len(list(saver.dirs[-1].glob("*.distcp")))
finally:
    stop_dcp_process()
    dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_dcp_saver_starts_dcp_checkpoint_process_untimed_and_writes_with_its_threads(tmp_path: Path) -> None:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", RANK, str(tmp_path)], env=env, capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "process_before": False,
        "process_after_init": True,  # spawned by the untimed warm-up, not by the first timed save
        "warm_dir_left": False,
        "fence_s": 0.0,
        "files": 2,  # FileSystemWriter(thread_count=2): a file per thread
    }
