"""A one-rank job for the fault tests: a real Checkpointer in the test process and its real daemon.

:func:`single_job` yields a :class:`SingleJob` whose daemon reads its fault rules from
``job.fault_file`` (see :mod:`ckptd.daemon.faults`) at every file it opens, so a test switches a
disk fault on and off while everything runs. Its runtime directory is made, checked and removed
as the ``runtime_dir`` fixture's (tools.harness.daemons.private_runtime_dir). On exit the daemon
is stopped and the test fails if it left shared memory, socket or pid files, or a process behind,
or if the daemon logged an internal error (ckptd.daemon.guard) that the test did not expect
(``job.internal_errors_expected``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptd
from ckptd import ShardedObject, ShardedTensor
from ckptd.control.pidfile import daemon_alive, daemon_pid
from ckptd.daemon.guard import MARKER as INTERNAL_ERROR
from ckptd.format.durable import ATOMIC_TMP_SUFFIX, atomic_tmp_name
from ckptd.format.rootlayout import PART_SUFFIX, TMP_SUFFIX, TRACKER_FILE, step_dir_name
from ckptd.verify import verify_checkpoint
from tests.multiproc import clear_torchrun_env
from tools.harness.daemons import private_runtime_dir, stop_daemons
from tools.harness.waiting import wait_until

HEARTBEAT_S = 0.1


def values(step: int) -> torch.Tensor:
    return torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) + step * 0.5


def state_dict(step: int, w: torch.Tensor | None = None) -> dict[str, Any]:
    w = values(step) if w is None else w
    return {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "o": ShardedObject("o", {"step": step}, (1,), (0,)),
        "iteration": step,
    }


def loads_bit_exact(ckpt: ckptd.Checkpointer, step: int) -> None:
    out = ckpt.load(state_dict(-1, torch.zeros(64, 48)), step=step)
    assert torch.equal(out["w"], values(step)) and out["o"] == {"step": step} and out["iteration"] == step
    report = verify_checkpoint(ckpt.checkpoint_dir(step), deep=True)
    assert report.ok, report.findings


def tmp_leftovers(root: Path) -> list[str]:
    """Partial saves still in the root: ``*.tmp`` directories, ``.part`` files and unfinished atomic
    writes anywhere (but the tracker's, which a commit in flight may be writing).

    The daemon may be removing an aborted step's directory while this looks, so a directory that
    vanishes mid-walk counts as gone (``os.walk`` skips it) instead of failing the scan as
    ``Path.rglob`` does."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if name.endswith((TMP_SUFFIX, ATOMIC_TMP_SUFFIX, PART_SUFFIX)) and name != atomic_tmp_name(TRACKER_FILE):
                found.append(str((Path(dirpath) / name).relative_to(root)))
    return sorted(found)


@dataclass
class SingleJob:
    root: Path
    runtime: Path
    fault_file: Path
    config: ckptd.CkptdConfig
    ckpt: ckptd.Checkpointer
    internal_errors_expected: bool = False

    @property
    def daemon_pid(self) -> int:
        pid = daemon_pid(self.ckpt.endpoints.pid_path)
        assert pid is not None and daemon_alive(self.ckpt.endpoints.pid_path)
        return pid

    def daemon_log(self) -> str:
        path = self.ckpt.endpoints.log_path
        return path.read_text(errors="replace") if path.exists() else ""

    def fault(self, rules: str) -> None:
        """Switch the daemon's disk faults to ``rules`` ('' clears them)."""
        if rules:
            self.fault_file.write_text(rules + "\n")
        else:
            self.fault_file.unlink(missing_ok=True)

    def committed(self, step: int, timeout_s: float = 30) -> None:
        """Save ``step`` and require that it commits and loads bit-exact."""
        h = self.ckpt.save(state_dict(step), step=step)
        assert h.wait(timeout_s=timeout_s) == self.root / step_dir_name(step)
        loads_bit_exact(self.ckpt, step)

    def failed(self, step: int, timeout_s: float = 30) -> str:
        """Save ``step``, require that it fails on its handle; return the error, once the step's
        partial files are gone."""
        h = self.ckpt.save(state_dict(step), step=step)
        try:
            h.wait(timeout_s=timeout_s)
        except ckptd.SaveFailedError as exc:
            assert h.status is ckptd.SaveStatus.ABORTED
            wait_until(lambda: not tmp_leftovers(self.root), 10, f"{tmp_leftovers(self.root)} to be removed")
            assert not (self.root / step_dir_name(step)).exists()
            return str(exc)
        raise AssertionError(f"step {step} committed despite the fault")


@contextlib.contextmanager
def single_job(tmp_path: Path, monkeypatch: Any, **config: Any) -> Iterator[SingleJob]:
    clear_torchrun_env(monkeypatch)
    root = Path(config.pop("root", tmp_path / "ckpts"))
    fault_file = tmp_path / "faults"
    # The runtime_dir fixture's directory: its end checks the job's staging segments.
    with private_runtime_dir(tmp_path / "daemon-logs") as runtime:
        settings = {
            "runtime_dir": str(runtime),
            "heartbeat_s": HEARTBEAT_S,
            "idle_exit_s": 60.0,
            "debug_fault_file": str(fault_file),
            "commit_timeout_s": 10.0,
            "request_timeout_s": 20.0,
        }
        settings.update(config)
        cfg = ckptd.CkptdConfig.from_env({}, **settings)
        ckpt = ckptd.Checkpointer(root, config=cfg)
        ep = ckpt.endpoints
        job = SingleJob(root, runtime, fault_file, cfg, ckpt)
        try:
            yield job
            ckpt.close()
        finally:
            ckpt.close(wait=False)
            stop_daemons([ep.pid_path])
            files = [p.name for p in (ep.socket_path, ep.pid_path) if p.exists()]
            daemon_log = job.daemon_log()
        assert not files, files
    if not job.internal_errors_expected:
        assert INTERNAL_ERROR not in daemon_log, daemon_log[daemon_log.index(INTERNAL_ERROR) - 200 :][:4000]
