"""``ckptd bench train``'s targets and table from results (no processes): a save that began while
the ring was being pinned is not a steady save, and a run with no steady save says the steady
targets were not measured instead of holding a pinning-bound stall against the floor."""

from __future__ import annotations

from typing import Any

from benchmarks.train import render, targets


def _results(ckptd: dict[str, Any]) -> dict[str, Any]:
    main = {
        "ranks": 1,
        "parameters": 320e6,
        "state_bytes": 3 << 30,
        "tensors": 980,
        "step_s": 0.05,
        "d2h_floor_s": 0.07,
        "intervals": {
            "25": {
                "none": {"loop_s": 2.4, "fence_s": 0.0, "overhead": 0.0},
                "dcp_best": {"loop_s": 9.8, "fence_s": 1.3, "overhead": 3.0, "first_blocked_s": 1.34},
                "ckptd": {
                    "loop_s": 4.3,
                    "fence_s": 0.0,
                    "overhead": 0.75,
                    "first_stall_s": 0.15,
                    "first_blocked_s": 0.15,
                    "stall_s_max": 0.6,
                    **ckptd,
                },
            }
        },
    }
    return {
        "config": {"model": "gpt", "device": "cuda", "saves": 2},
        "machine": {"device_name": "GPU", "torch": "2.x"},
        "main": main,
    }


def test_a_run_whose_later_saves_all_fell_inside_the_pinning_has_no_steady_figure():
    res = _results({"saves_in_pinning": [1, 1], "stall_s_in_pinning_max": 0.615})
    found = {t["name"]: t for t in targets(res["main"])}
    floor = found["every 25: ckptd steady stall / device-to-host floor (after a synchronisation)"]
    assert floor["value"] is None and floor["ok"] is None
    assert found["every 25: ckptd first stall / steady"]["ok"] is None
    assert found["every 25: ckptd overhead / DCP best's"]["ok"] is True
    res["targets"] = list(found.values())
    text = render(res)
    assert "not measured" in text and "MISSED" not in text
    assert "0.615" in text  # the pinning-bound stall is shown, in its own column


def test_a_steady_save_is_held_against_the_floor():
    res = _results({"stall_s_median": 0.2, "saves_in_pinning": [0, 0]})
    found = {t["name"]: t for t in targets(res["main"])}
    floor = found["every 25: ckptd steady stall / device-to-host floor (after a synchronisation)"]
    assert floor["value"] == 0.2 / 0.07 and floor["ok"] is False
    res["targets"] = list(found.values())
    assert "MISSED" in render(res)


def test_the_steady_stall_less_its_ring_wait_is_held_against_the_same_copy_in_the_loop():
    # A save that waited for the daemon to drain the one before (backpressure) is not a slow copy;
    # the copy where the save is waits for the GPU work queued before it, as the save does.
    res = _results({"stall_s_median": 0.33, "stall_s_own_median": 0.085, "saves_in_pinning": [0, 0]})
    res["main"]["intervals"]["25"]["d2h"] = {"loop_s": 2.5, "fence_s": 0.0, "overhead": 0.04, "stall_s_median": 0.093}
    found = {t["name"]: t for t in targets(res["main"])}
    own = found["every 25: ckptd steady stall less ring-space wait / plain D2H copy in the loop"]
    assert own["value"] == 0.085 / 0.093 and own["ok"] is True
    whole = found["every 25: ckptd steady stall / plain D2H copy in the loop"]
    assert whole["value"] == 0.33 / 0.093 and whole["ok"] is False
    res["targets"] = list(found.values())
    text = render(res)
    assert "plain D2H copy" in text and "0.085" in text and "own med" in text
