"""The benchmark's memory sampler (benchmarks.memory) with real processes: it finds what a
rank process started, and what a failed job orphaned is killed at cleanup."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.memory import MemorySampler, proc_memory

# A "rank" that starts a long-lived child (as DCP's checkpoint process is) and then waits.
RANK = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
)


@pytest.mark.timeout(60)
def test_children_a_failed_job_orphaned_are_killed_at_cleanup(tmp_path):
    rank = subprocess.Popen([sys.executable, "-c", RANK])
    sampler = MemorySampler(tmp_path, tmp_path / "phase")
    sampler.watch(lambda: [rank.pid])
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(rank.pid).children():
            assert time.monotonic() < deadline, "the rank started no child"
            time.sleep(0.05)
        child = psutil.Process(rank.pid).children()[0]
        sampler.sample()
        assert sampler.peaks()["setup"]["dcp_bg_rss"] > 0  # sampled as the rank's child
        rank.kill()  # the job failed: its rank is gone, its child orphaned
        rank.wait(10)
        assert child.is_running()
        assert sampler.kill_leftovers() == [child.pid]
        assert not child.is_running() and sampler.kill_leftovers() == []
    finally:
        rank.kill()
        rank.wait(10)


def test_proc_memory_reads_rss_and_shared_memory_at_once():
    mem = proc_memory(psutil.Process().pid)
    assert mem is not None and mem["rss"] >= mem["shm"] >= 0 and mem["private"] == mem["rss"] - mem["shm"]
    assert proc_memory(2**22 + 12345) is None  # no such process
