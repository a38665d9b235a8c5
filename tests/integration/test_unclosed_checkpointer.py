"""Issue 26.3: a Checkpointer dropped without close() must release its connection at once and
never hang the process (a garbage collection once waited forever in pyzmq's Context.__del__)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.multiproc import without_torchrun
from tools.harness.waiting import wait_until

_SCRIPT = textwrap.dedent(
    """
    import gc, sys, time
    import torch
    import ckptd

    root, runtime, pending = sys.argv[1], sys.argv[2], sys.argv[3] == "pending"
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=1.0)
    ckpt = ckptd.Checkpointer(root, config=cfg)
    print("latest", ckpt.latest(), flush=True)
    if pending:  # a save in flight: the Checkpointer and its handle refer to each other
        w = torch.arange(1024.0)
        ckpt.save({"w": ckptd.ShardedTensor.from_rank_offsets("w", w)}, step=1)
    del ckpt
    t0 = time.monotonic()
    gc.collect()
    print(f"collected in {time.monotonic() - t0:.3f} s", flush=True)
    """
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pending", ["idle", "pending"])
def test_a_dropped_checkpointer_never_hangs_the_process(tmp_path, pending, runtime_dir):
    root = tmp_path / "root"
    runtime = str(runtime_dir)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(root), runtime, pending],
        env=without_torchrun(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "collected in" in proc.stdout
    assert "dropped without close()" in proc.stderr
    if pending == "pending":
        # The daemon owns a save it acknowledged: it commits although its Checkpointer is gone.
        wait_until(lambda: (root / "iter_0000001" / "metadata.json").exists(), 30, "step 1 to commit")
