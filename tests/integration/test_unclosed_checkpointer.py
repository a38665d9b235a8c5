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


_EXITS_WHILE_ITS_CHILD_WAITS = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import torch
    import ckptd
    from ckptd.staging import children

    root, runtime, pids = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, idle_exit_s=60.0, staging_budget="0.25x")
    ckpt = ckptd.Checkpointer(root, config=cfg)
    daemon = ckpt._link.daemon_pid
    pids.write_text(str(daemon))
    after_ack = children.ForkProducer.after_ack

    def stall_daemon(producer):  # the daemon stops draining the ring right after it took the save
        os.kill(daemon, signal.SIGSTOP)
        return after_ack(producer)

    children.ForkProducer.after_ack = stall_daemon
    ckpt.save({"w": torch.randn(1_000_000)}, step=1)  # 4 MB through a 1 MB ring
    print("saved", flush=True)
    os._exit(0)  # the trainer is gone; its snapshot child waits for ring room
    """
)


@pytest.mark.timeout(120)
def test_a_snapshot_child_holds_none_of_the_trainers_descriptors(tmp_path, runtime_dir):
    """A fork snapshot's child waiting for ring room when its trainer exited kept the trainer's
    stdout and stderr open: a launcher reading them (here ``subprocess.run(capture_output=True)``)
    waited for the child to give up (``snapshot_timeout_s``, 600 s by default)."""
    import signal

    root, pids = tmp_path / "root", tmp_path / "daemon.pid"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _EXITS_WHILE_ITS_CHILD_WAITS, str(root), str(runtime_dir), str(pids)],
            env=without_torchrun(os.environ),
            capture_output=True,
            text=True,
            timeout=45,  # the trainer exits at once; before, its pipes stayed open for 600 s
        )
        assert proc.returncode == 0 and "saved" in proc.stdout, proc.stdout + proc.stderr
    finally:
        if pids.exists():
            os.kill(int(pids.read_text()), signal.SIGCONT)
    wait_until(lambda: (root / "iter_0000001" / "metadata.json").exists(), 60, "step 1 to commit")


@pytest.mark.timeout(120)
def test_a_dropped_checkpointer_with_an_attached_optimizer_is_freed_at_once(tmp_path, runtime_dir, single_process):
    """Without the cyclic collector: the optimizer's step hook and the attempt counter held the
    Checkpointer strongly while it held them (through its ring and its tries), so one dropped
    without close() lived on, connection and ring included, until a collection found the cycle."""
    import gc
    import weakref

    import torch

    import ckptd

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=str(runtime_dir), idle_exit_s=2.0)
    gc.collect()
    gc.disable()
    try:
        ckpt = ckptd.Checkpointer(tmp_path / "root", config=cfg)
        ckpt.attach(opt)
        sd = {"w": ckptd.ShardedTensor.from_rank_offsets("w", model.weight.detach())}
        ckpt.save(sd, step=1).wait(timeout_s=60)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()  # the hook fences
        gone = weakref.ref(ckpt)
        del ckpt
        assert gone() is None
        opt.step()  # a hook of a Checkpointer that is gone does nothing
    finally:
        gc.enable()


_FAILING_CONSTRUCTORS = textwrap.dedent(
    """
    import gc, sys
    import ckptd
    from ckptd.control.endpoints import JobEnv

    root, runtime = sys.argv[1], sys.argv[2]
    cfg = ckptd.CkptdConfig.from_env({}, runtime_dir=runtime, daemon_start_timeout_s=0.5)
    # Local rank 1 of 2: the daemon its local rank 0 would start never appears (DaemonError).
    env = JobEnv(rank=1, local_rank=1, world_size=2, local_world_size=2)
    try:
        with ckptd.Checkpointer(root, config=cfg, env=env):
            pass
    except ckptd.DaemonError as exc:
        print("connect raised:", exc, flush=True)
    # policy='auto' on two ranks without torch.distributed: refused before anything is made.
    try:
        ckptd.Checkpointer(root + "-auto", config=cfg.replace(policy="auto", mtbf_s=60.0), env=env)
    except ckptd.CkptdError as exc:
        print("policy raised:", exc, flush=True)
    gc.collect()
    print("collected", flush=True)
    """
)


@pytest.mark.timeout(120)
def test_a_constructor_that_raises_leaves_no_dropped_checkpointer(tmp_path, runtime_dir):
    """A Checkpointer whose constructor raised was never the caller's to close: its connection is
    released before the error leaves, and neither a collection nor the interpreter's exit reports
    it as dropped without close()."""
    proc = subprocess.run(
        [sys.executable, "-c", _FAILING_CONSTRUCTORS, str(tmp_path / "root"), str(runtime_dir)],
        env=without_torchrun(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "connect raised: no ckptd daemon" in proc.stdout, proc.stdout + proc.stderr
    assert "policy raised: policy='auto' with several ranks" in proc.stdout, proc.stdout + proc.stderr
    assert "collected" in proc.stdout and not (tmp_path / "root-auto").exists()
    assert "dropped without close()" not in proc.stderr, proc.stderr
