"""Guarantee 4 with a disk that hangs before any write of a step completes (issue 25): the step
aborts within ``commit_timeout_s`` (plus the daemon's tick), while the write still hangs, with a
reason naming the file; once the disk answers again the late write's files are removed and the
same step saves and commits. Before, the coordinator learnt of a step only from a finished write,
so such a step never aborted: ``wait()`` timed out for as long as the disk hung.

The hang is the fault file's ``hang`` rule (ckptd.daemon.faults): the daemon's open of the data
file blocks until the test removes the rule.
"""

from __future__ import annotations

import pytest

import ckptd
from ckptd.format.rootlayout import step_dir_name
from tests.fault.single_job import single_job, state_dict, tmp_leftovers
from tools.harness.waiting import wait_until

COMMIT_TIMEOUT_S = 2.0
MARGIN_S = 15.0  # the tick (0.1 s here) and the messages, on a loaded 2-core machine


@pytest.mark.timeout(120)
def test_a_hung_disk_aborts_the_step_within_commit_timeout(tmp_path, monkeypatch):
    with single_job(tmp_path, monkeypatch, commit_timeout_s=COMMIT_TIMEOUT_S) as job:
        job.committed(1)
        job.fault("hang __*")  # every data file's open hangs
        try:
            first = job.ckpt.save(state_dict(2), step=2)
            second = job.ckpt.save(state_dict(3), step=3)  # queued behind the hung write
            for h in (first, second):
                with pytest.raises(ckptd.SaveFailedError, match=r"was not written within 2 s of its SAVE") as err:
                    h.wait(timeout_s=COMMIT_TIMEOUT_S + MARGIN_S)
                assert h.status is ckptd.SaveStatus.ABORTED and "CKPTD_COMMIT_TIMEOUT_S" in str(err.value)
            assert "__0_0.distcp" in str(err.value) and f"iter_{3:07d}." in str(err.value)
            # Decided while the disk still hangs: the hang was never released, nothing was written.
            log = job.daemon_log()
            assert "injected fault: the open of" in log and "injected fault: the hang of" not in log
            assert job.ckpt.latest() == 1
        finally:
            job.fault("")  # the disk answers again: the late writes end and their files are removed
        wait_until(lambda: not tmp_leftovers(job.root), 30, "the late writes' files to be removed")
        assert not (job.root / step_dir_name(2)).exists()
        job.committed(2)
        job.committed(3)
        assert job.ckpt.latest() == 3


@pytest.mark.timeout(120)
def test_a_daemon_stopped_while_a_write_hangs_exits_within_its_grace_and_frees_everything(tmp_path, monkeypatch):
    """SIGTERM while a data file's write hangs: the daemon waits ``shutdown_grace_s`` for it, then
    exits without it, its pid lock and staging segments released, so a relaunch's daemon can
    start. Before, its close joined the hung writer thread forever."""
    import os
    import signal
    from pathlib import Path

    from ckptd.control.pidfile import daemon_alive

    with single_job(tmp_path, monkeypatch, shutdown_grace_s=1.0) as job:
        job.committed(1)
        pid, prefix = job.daemon_pid, job.ckpt.endpoints.shm_prefix
        job.fault("hang __*")
        try:
            h = job.ckpt.save(state_dict(2), step=2)
            wait_until(lambda: "injected fault: the open of" in job.daemon_log(), 30, "the write to hang")
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the daemon to exit")
            assert not daemon_alive(job.ckpt.endpoints.pid_path)
            assert "did not stop within 1 s" in job.daemon_log()
            assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
            with pytest.raises(ckptd.SaveFailedError, match="died"):
                h.wait(timeout_s=30)
        finally:
            job.fault("")
        # Its pid file stays (its lock went with the process): the next daemon takes it over.
        job.committed(3)
        assert job.daemon_pid != pid


@pytest.mark.timeout(120)
def test_ckptd_daemon_stop_waits_as_long_as_the_daemons_own_settings_let_it_stop(tmp_path, monkeypatch):
    """A daemon stopping with a write hung takes its shutdown grace twice (its work in flight, then
    its writer thread) and exits. ``ckptd daemon stop`` waited the grace of its own shell plus
    10 s, and reported "did not stop" (exit 1) for a daemon stopping normally; it now waits for the
    bound that daemon reports from its own settings."""
    import os
    import time
    from pathlib import Path

    from ckptd.control.pidfile import daemon_alive
    from tests.cli import ckptd_cli

    grace_s = 7.0  # the stop takes ~2 x 7 s: past the 0.5 + 10 s the shell's own setting gave
    with single_job(tmp_path, monkeypatch, shutdown_grace_s=grace_s) as job:
        job.committed(1)
        pid = job.daemon_pid
        job.fault("hang __*")
        try:
            h = job.ckpt.save(state_dict(2), step=2)
            wait_until(lambda: "injected fault: the open of" in job.daemon_log(), 30, "the write to hang")
            env = {**os.environ, "CKPTD_RUNTIME_DIR": str(job.runtime), "CKPTD_SHUTDOWN_GRACE_S": "0.5"}
            started = time.monotonic()
            run = ckptd_cli(env, "daemon", "stop", "--root", str(job.root), timeout_s=90)
            took_s = time.monotonic() - started
            assert run.returncode == 0 and f"stopped the daemon of node 0 (pid {pid})" in run.stdout, (
                took_s,
                run.stdout,
                run.stderr,
            )
            assert took_s > 2 * grace_s - 1 and not daemon_alive(job.ckpt.endpoints.pid_path)
            wait_until(lambda: not Path(f"/proc/{pid}").exists(), 30, "the daemon to be gone")
            assert f"did not stop within {grace_s:.0f} s" in job.daemon_log()
            with pytest.raises(ckptd.SaveFailedError):
                h.wait(timeout_s=30)
        finally:
            job.fault("")
        job.committed(3)  # a new daemon takes over the pid file the stuck one's exit left
