"""``ckptd bench all`` end to end at a tiny size: every section of its JSON, and nothing left behind.

DCP's PROCESS executor is left out (its checkpoint process alone takes seconds to start); the
suite's other parts all run: reference limits, saves, training loop, small tensors, scaling,
load, memory and the targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ckptd.bench.suite import main


@pytest.mark.timeout(60)
def test_bench_all_tiny_reports_every_section_and_cleans_up(tmp_path, capsys):
    rc = main(["--ranks", "1", "--state-gib", "0.015625", "--tensor-mib", "2", "--small-tensors", "64",
               "--small-gib", "0.002", "--repeats", "1", "--scale-ranks", "1", "--load-gib", "0.002",
               "--train-saves", "1", "--train-every", "1", "--methods", "ckptd,dcp_save,dcp_async_thread",
               "--dir", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {"config", "machine", "main", "scaling", "load", "memory", "targets", "cleanup"} <= set(data)
    main_ = data["main"]
    assert main_["memcpy_s"] > 0 and main_["state_bytes"] > 0
    for method in ("ckptd", "dcp_save", "dcp_async_thread"):
        s = main_["save"][method]
        assert s["stall_s_median"] > 0 and s["stall_s_max"] >= s["stall_s_median"]
        assert s["durable_s_median"] >= s["stall_s_median"] and s["persist_gibps"] > 0
    refs = main_["save"]["ckptd"]["write_ref"]
    assert refs and all(v > 0 for v in refs[0].values())
    assert main_["small"]["ckptd"]["stall_s_median"] > 0 and main_["small_tensors"] == 64
    train = main_["train"]
    assert train["none"]["steps_per_s"] > 0 and "overhead" in train["ckptd"]
    assert data["scaling"][0]["ranks"] == 1 and data["scaling"][0]["stall_s_median"] > 0
    load = data["load"]
    assert load["ckptd_same_layout_gibps"] > 0 and load["dcp_load_gibps"] > 0
    assert set(load["ckptd_reshard_gibps"]) == {"tp1", "tp4", "tp2dp2-flat"}
    mem = data["memory"]
    assert mem["save:ckptd"]["trainer_rss"] > 0 and mem["all"]["daemon_private"] > 0
    assert mem["all"]["daemon_cpu_s"] >= 0 and "node_cpu_s" in mem["all"]
    names = {t["name"] for t in data["targets"]}
    assert {"persist_vs_write", "daemon_memory"} <= names  # the others need DCP's PROCESS executor
    cleanup = data["cleanup"]
    assert cleanup["daemons_not_stopped"] == [] and cleanup["daemons_alive"] == []
    assert cleanup["shm_left"] == [] and cleanup["dir_removed"] and cleanup["runtime_removed"]
    assert list(tmp_path.iterdir()) == []
    prefix = data["config"]["shm_prefix"]
    assert prefix.startswith("ckptd-bn") and not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.mark.timeout(150)
def test_bench_save_tiny_measures_dcp_first_and_cleans_up(tmp_path):
    """``ckptd bench save`` (the asynchronous-save targets) end to end: DCP's plain async_save
    and a reused stager, ckptd, the pool phase; a real daemon, nothing left behind."""
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("ckptd")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "bench", "save", "--ranks", "2", "--state-gib", "0.03",
         "--tensor-mib", "4", "--repeats", "1", "--pool-saves", "2", "--pool-state-gib", "0.01",
         "--dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=140, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for line in ("torch DCP save (sync):", "torch DCP async_save PROCESS: stall",
                 "with one stager reused:", "ckptd Checkpointer.save: stall", "pool over 2 saves",
                 "stall / DCP-async stall =", "committed / DCP sync save ="):
        assert line in out, out
    assert list((tmp_path / "d").iterdir()) == []  # every checkpoint removed
    assert {n for n in os.listdir("/dev/shm") if n.startswith("ckptd")} <= shm_before
