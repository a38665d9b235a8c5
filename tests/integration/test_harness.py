"""The test harness's own bounds (tools/harness): stopping daemons and spawned processes never
waits past its bound, and what outlives it is killed and reported, not left running; a private
runtime directory (the runtime_dir fixture's) keeps its daemons' logs and reports what they left.

The daemons here are stand-ins that hold a pid file with ckptd's own PidLock (what makes a daemon
live to everyone else) and whose command line names ``ckptd.cli`` and the job, as a daemon's does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptd.control.pidfile import daemon_alive
from ckptd.staging.segment import SHM_DIR, ShmSegment, new_generation, segment_name
from tools.harness.daemons import DaemonsDidNotStop, daemon_processes, private_runtime_dir, stop_daemons
from tools.harness.ranks import run_ranks, spawned
from tools.harness.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]

STAND_IN = """
import signal, sys, time
from pathlib import Path
from ckptd.control.pidfile import PidLock
if sys.argv[2] == "ignore-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[2] == "late-pid":  # PidLock's own order, slowed down: the lock, then the pid
    import fcntl, os
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    time.sleep(1.5)
    os.write(fd, f"{os.getpid()}\\n".encode())
elif sys.argv[1] and not PidLock(Path(sys.argv[1])).acquire():
    sys.exit(3)
time.sleep(300)
"""


def _stand_in(pid_path: Path | None, on_sigterm: str, job: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", STAND_IN, str(pid_path or ""), on_sigterm, "ckptd.cli", job])


@pytest.fixture
def stand_ins():
    procs: list[subprocess.Popen] = []

    def start(pid_path: Path | None, on_sigterm: str = "die", job: str = "harnesstest") -> subprocess.Popen:
        proc = _stand_in(pid_path, on_sigterm, job)
        procs.append(proc)
        if pid_path is not None:
            wait_until(lambda: daemon_alive(pid_path) or proc.poll() is not None, 60, f"{pid_path} to be locked")
            assert proc.poll() is None, proc.returncode
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.timeout(120)
def test_stop_daemons_sigterms_each_and_returns_their_pids(tmp_path, stand_ins):
    paths = [tmp_path / "j-n0.pid", tmp_path / "j-n1.pid"]
    procs = [stand_ins(p) for p in paths]
    assert stop_daemons(paths, 30) == [p.pid for p in procs]
    assert [p.wait(timeout=10) for p in procs] == [-signal.SIGTERM] * 2
    assert stop_daemons(paths, 30) == []  # nothing left to stop


@pytest.mark.timeout(120)
def test_a_daemon_that_holds_its_pid_file_before_writing_its_pid_is_stopped_too(tmp_path, stand_ins):
    """A daemon takes its pid file's lock, then writes its pid: a stop in between saw the lock held
    but no pid, and returned without it (the daemon went on running; once, under load, in the suite)."""
    path = tmp_path / "j-n0.pid"
    proc = stand_ins(path, "late-pid")
    assert stop_daemons([path], 30) == [proc.pid]
    assert proc.wait(timeout=10) == -signal.SIGTERM


@pytest.mark.timeout(120)
def test_a_daemon_that_ignores_sigterm_is_killed_and_fails_the_stop(tmp_path, stand_ins):
    path = tmp_path / "j-n0.pid"
    proc = stand_ins(path, "ignore-sigterm")
    t0 = time.monotonic()
    with pytest.raises(DaemonsDidNotStop, match=rf"\[{proc.pid}\] still ran 1 s after SIGTERM"):
        stop_daemons([path], 1.0)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert time.monotonic() - t0 < 30  # bounded: 1 s, the kill, and the poll


@pytest.mark.timeout(120)
def test_a_job_process_without_a_pid_file_is_waited_for(tmp_path, stand_ins):
    """A daemon still starting (no pid file yet) counts when the job is named: the stop waits for it."""
    job = f"harness{time.monotonic_ns()}"
    proc = stand_ins(None, "ignore-sigterm", job=job)
    wait_until(lambda: proc.pid in daemon_processes(job), 30, "the stand-in to be listed")
    assert stop_daemons([tmp_path / "none-n0.pid"], 1.0) == []  # without the job: nothing to stop
    with pytest.raises(DaemonsDidNotStop):
        stop_daemons([tmp_path / "none-n0.pid"], 1.0, job=job)
    assert proc.wait(timeout=10) == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_a_runtime_dir_is_removed_with_its_daemons_logs_kept(tmp_path, stand_ins):
    job = f"harness{time.monotonic_ns()}"
    with private_runtime_dir(tmp_path / "logs", timeout_s=30) as runtime:
        proc = stand_ins(runtime / f"{job}-n0.pid")
        (runtime / f"{job}-n0.log").write_text("the daemon's story\n")
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not runtime.exists()
    assert (tmp_path / "logs" / f"{job}-n0.log").read_text() == "the daemon's story\n"


@pytest.mark.timeout(120)
def test_a_runtime_dir_fails_on_a_killed_daemon_and_a_leftover_segment(tmp_path, stand_ins):
    """What the runtime_dir fixture fails a test for: a daemon that outlived its bound (killed),
    and a staging segment of a job of the directory (its job named by the pid file or the token)."""
    job, other = f"harness{time.monotonic_ns()}", f"harness{time.monotonic_ns()}x"
    segments = [SHM_DIR / segment_name(f"ckptd-{j}-n1-", 0, new_generation(), 0) for j in (job, other)]
    try:
        with pytest.raises(AssertionError) as failed, private_runtime_dir(tmp_path / "logs", 1.0) as runtime:
            proc = stand_ins(runtime / f"{job}-n0.pid", "ignore-sigterm")
            (runtime / f"{other}.token").write_text("a token\n")
            for segment in segments:
                ShmSegment.create(segment.name, 4096).close()
        assert f"[{proc.pid}] still ran 1 s after SIGTERM" in str(failed.value)
        assert all(str(segment) in str(failed.value) for segment in segments), failed.value
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not runtime.exists()
    finally:
        for segment in segments:
            segment.unlink(missing_ok=True)


@pytest.mark.timeout(60)
def test_spawned_kills_what_outlives_its_join_bound():
    with spawned([(time.sleep, (300,)), (time.sleep, (0,))], join_timeout_s=5) as procs:
        pass
    assert procs.killed == [0]
    assert [p.exitcode for p in procs] == [-signal.SIGKILL, 0]


def _rank_0_fails_while_rank_1_waits(rank: int, world_size: int) -> int:
    if rank == 0:
        raise ValueError("rank 0's own error")
    time.sleep(300)  # as a rank waiting for rank 0 (a store, a collective with a long timeout)
    return rank


def _rank_1_hangs(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(300)
    return rank


@pytest.mark.timeout(60)
def test_a_failed_rank_is_reported_with_the_stacks_of_the_ranks_still_waiting():
    """Rank 1 waits for rank 0, which failed: the test gets rank 0's traceback and where rank 1
    waits, a grace period after the failure, not when the run's bound ends."""
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_rank_0_fails_while_rank_1_waits, 2, timeout_s=40, failed_rank_grace_s=3)
    assert time.monotonic() - start < 40
    report = str(failed.value)
    assert "--- rank 0 failed:" in report and "ValueError: rank 0's own error" in report, report
    assert "ranks [1] had not finished 3 s after that" in report, report
    assert "--- rank 1's stacks:" in report and "in _rank_0_fails_while_rank_1_waits" in report, report


@pytest.mark.timeout(60)
def test_a_hung_rank_times_out_with_its_stacks():
    with pytest.raises(TimeoutError) as hung:
        run_ranks(_rank_1_hangs, 2, timeout_s=5)
    report = str(hung.value)
    assert report.startswith("ranks [1] did not finish in 5s; killed:"), report
    assert "--- rank 1's stacks:" in report and "in _rank_1_hangs" in report, report


_BURNS = """
import subprocess, sys


def test_burns_in_a_child():
    code = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sleeps():
    import time

    time.sleep(0.5)
"""


@pytest.mark.timeout(120)
def test_cpu_per_test_counts_the_processes_a_test_starts(tmp_path):
    if not Path("/sys/fs/cgroup/cpuacct").is_dir():
        pytest.skip("no cgroup v1 cpuacct controller here")
    (tmp_path / "test_burn.py").write_text(_BURNS)
    out = tmp_path / "cpu.tsv"
    env = {**os.environ, "CPU_PER_TEST_OUT": str(out), "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n0",
            "-p",
            "tools.cpu_per_test",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split("\t")[0].split("::")[1]: line.split("\t") for line in out.read_text().splitlines()}
    assert float(rows["test_burns_in_a_child"][1]) >= 0.5  # the child's CPU counts
    assert float(rows["test_sleeps"][1]) < 0.25 and float(rows["test_sleeps"][2]) >= 0.5
