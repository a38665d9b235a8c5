"""``ckptd bench all`` end to end at a tiny size, from the command line: every section of its JSON,
every target evaluated from figures of the run, and nothing left behind.

One run covers every part (reference limits, saves by every method, DCP's PROCESS executor
included, lazy, budget, soak, training loop, small tensors, scaling, load, memory, the targets):
each part is cheap at this size, while a run's start (its ranks, their daemon, DCP's checkpoint
process) costs seconds, so one run proves what two did in half the time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.suite_report import render


@pytest.mark.timeout(150)
def test_bench_all_cli_reports_every_section_and_target_and_cleans_up(tmp_path):
    """``ckptd bench all`` from the command line with every save method, DCP's PROCESS executor
    with its stager reused and as called: every section of the JSON; the first-save, node
    /dev/shm, budget, soak, training and small-tensor targets evaluated from figures of this
    run; a real daemon; nothing left behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTD_")}
    out_file = tmp_path / "res.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptd.cli",
            "bench",
            "all",
            "--ranks",
            "2",
            "--state-gib",
            "0.03",
            "--tensor-mib",
            "4",
            "--repeats",
            "1",
            "--small-tensors",
            "64",
            "--small-gib",
            "0.002",
            "--scale-ranks",
            "1,2",
            "--load-gib",
            "0.002",
            "--train-saves",
            "1",
            "--train-every",
            "1",
            "--soak-saves",
            "3",
            "--soak-gib",
            "0.01",
            "--methods",
            "ckptd,dcp_save,dcp_async_thread,dcp_async_process,dcp_async_process_new",
            "--dir",
            str(tmp_path / "d"),
            "--out",
            str(out_file),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=140,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out_file.read_text())
    assert json.loads(proc.stdout) == res  # --json prints what --out writes
    assert {"config", "machine", "main", "scaling", "load", "memory", "targets", "cleanup"} <= set(res)
    main_ = res["main"]
    assert main_["memcpy_s"] > 0 and main_["state_bytes"] > 0
    saves = main_["save"]
    for method in ("ckptd", "dcp_save", "dcp_async_thread", "dcp_async_process", "dcp_async_process_new"):
        s = saves[method]
        assert s["first_stall_s"] > 0 and s["stall_s_median"] > 0, method
        assert s["stall_s_max"] >= s["stall_s_median"], method
        assert s["durable_s_median"] >= s["stall_s_median"] and s["persist_gibps"] > 0, method
        # One persist window for every asynchronous method: from save() returning to durable.
        if method != "dcp_save":
            for row in s["saves"]:
                assert row["persist_s"] == pytest.approx(row["durable_s"] - row["stall_s"]), (method, row)
    assert all(row["daemon_window_s"] > 0 for row in saves["ckptd"]["saves"])
    # DCP writes with the daemon's writer threads per rank (2 / 2 ranks).
    assert res["config"]["writer_threads"] == 2 and res["config"]["dcp_thread_count"] == 1
    refs = saves["ckptd"]["write_ref"]
    assert refs and all(v > 0 for v in refs[0].values())
    assert main_["small"]["ckptd"]["stall_s_median"] > 0 and main_["small_tensors"] == 64
    train = main_["train"]
    assert train["none"]["steps_per_s"] > 0 and "overhead" in train["ckptd"]
    assert res["scaling"][0]["ranks"] == 1 and res["scaling"][0]["stall_s_median"] > 0
    load = res["load"]
    assert load["ckptd_same_layout_gibps"] > 0 and load["dcp_load_gibps"] > 0
    assert set(load["ckptd_reshard_gibps"]) == {"tp1", "tp4", "tp2dp2-flat"}
    targets = {t["name"]: t for t in res["targets"]}
    for name in ("first_stall", "first_stall_vs_dcp", "node_shm", "budget", "soak_flat", "small_stall"):
        assert targets[name]["value"] is not None and targets[name]["value"] > 0, targets[name]
    assert {"train_overhead", "persist_vs_write", "daemon_memory"} <= set(targets)
    assert targets["gpu_lazy_stall"]["ok"] is None  # n/a on a CPU run
    # The scaling curve's 1-rank job has phases of its own: its rings never count as the main job's.
    mem = res["memory"]
    assert mem["save:ckptd"]["trainer_rss"] > 0 and mem["all"]["daemon_private"] > 0
    assert mem["all"]["daemon_cpu_s"] >= 0 and "node_cpu_s" in mem["all"]
    assert "scale1:save:ckptd" in mem
    assert all(not p.startswith("scale2:") for p in mem)  # 2 ranks: the main job is that point
    assert mem["save:ckptd"]["ckptd_shm"] <= targets["node_shm"]["limit"] * res["main"]["state_bytes"]
    assert res["main"]["budget"]["bit_exact"] and res["main"]["lazy"]["stall_s_median"] > 0
    assert len(res["main"]["soak"]["samples"]) == 3
    table = render(res)  # what the command prints without --json
    for line in (
        "DCP async PROCESS new",
        "ckptd with staging budget 0.25x",
        "ckptd soak, 3 saves",
        "ckptd snapshot=lazy: stall median",
        "first save's stall / DCP async's first",
        "many small tensors (64 tensors",
        "training loop: matmul",
        "load (GiB/s",
        "persist GiB/s = bytes / (durable - stall)",
        "DCP FileSystemWriter(thread_count=1) per rank; ckptd's daemon writer_threads=2 per node (2 ranks",
    ):
        assert line in table, table
    assert list((tmp_path / "d").iterdir()) == []  # every checkpoint removed
    cleanup = res["cleanup"]
    assert cleanup["daemons_not_stopped"] == [] and cleanup["daemons_alive"] == []
    assert cleanup["dir_removed"] and cleanup["runtime_removed"]
    prefix = res["config"]["shm_prefix"]  # of every segment this run made
    assert prefix.startswith("ckptd-bn")
    assert cleanup["shm_left"] == [] and not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
