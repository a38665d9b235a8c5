"""``ckptd bench train`` end to end at a tiny size on CPU: every mode, both intervals, the
bit-exact check of a save taken while training goes on, the targets, and nothing left behind.

DCP's best configuration is tried in order (the pinned async stager first); on CPU its PROCESS
executor starts a checkpoint process, which takes seconds, so one interval is short."""

from __future__ import annotations

import json

import pytest

from benchmarks.train import main


@pytest.mark.timeout(300)
def test_bench_train_tiny_on_cpu_reports_every_mode_and_cleans_up(tmp_path, capsys):
    rc = main(
        [
            "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "64", "--seq", "16", "--batch", "2",
            "--every", "3,1", "--saves", "2", "--dir", str(tmp_path), "--json",
            "--modes", "none,d2h,dcp_best,ckptd,ckptd_lazy",
        ]
    )  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    main_ = data["main"]
    assert main_["parameters"] > 0 and main_["tensors"] > 10 and main_["state_bytes"] > 0
    assert set(main_["intervals"]) == {"3", "1"}
    for every, iv in main_["intervals"].items():
        assert iv["none"]["loop_s"] > 0
        for mode in ("dcp_best", "ckptd", "ckptd_lazy"):
            x = iv[mode]
            assert "error" not in x, (every, mode, x)
            assert x["stall_s_median"] > 0 and x["first_stall_s"] > 0 and "overhead" in x, (every, mode)
        assert iv["ckptd_lazy"]["fence_s"] >= 0
        assert iv["d2h"]["stall_s_median"] >= 0 and "error" not in iv["d2h"]
        assert all(len(w) == 2 and min(w) >= 0 for w in iv["ckptd"]["ring_wait_s"]), iv["ckptd"]["ring_wait_s"]
        assert 0 < iv["ckptd"]["stall_s_own_median"] <= iv["ckptd"]["stall_s_median"] + 1e-9
        assert iv["dcp_best_kind"] == "dcp_async_pinned" and iv["dcp_failed"] == {}, iv["dcp_failed"]
    assert {m: v["bit_exact"] for m, v in main_["bit_exact"].items()} == {
        "dcp_best": True,
        "ckptd": True,
        "ckptd_lazy": True,
    }
    assert any(t["name"].endswith("overhead / DCP best's") for t in data["targets"])
    cleanup = data["cleanup"]
    assert cleanup["shm_left"] == [] and cleanup["shm_after"] == [] and cleanup["dir_removed"]
    assert cleanup["daemons_alive"] == [] and cleanup["processes_left"] == []
