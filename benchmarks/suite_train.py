"""The training-loop part of ``ckptd bench all``: what checkpointing costs a CPU training loop.

Each rank runs ``steps`` identical steps (one float32 matmul of an ``n x n`` matrix on one thread,
``n`` calibrated so that ``every`` steps take about as long as one save takes to become durable,
i.e. the shortest interval at which saves do not queue, then an in-place update of
``--train-update`` of the saved state, as an optimizer step rewrites the parameters and its
moments: what a copy-on-write snapshot pays for), saving its state every ``every`` steps:

- ``none``: no checkpointing (the baseline);
- ``ckptd``: ``Checkpointer.save`` with the default settings (CPU shards: a fork snapshot);
  ``ckptd_copy``: ``snapshot="copy"`` (the trainer copies inside ``save()``); ``ckptd_lazy``:
  ``snapshot="lazy"`` (the copy runs behind the matmul; ``before_update()`` fences it before the
  update, as ``attach(optimizer)`` does before an optimizer step);
- ``dcp_async_thread`` / ``dcp_async_process``: ``async_save(..., THREAD / PROCESS)`` with one
  stager reused (shared memory for PROCESS); as DCP requires, the previous save's future is waited
  for before the next save starts.

(The checkpointing modes are those of ``--methods``.)

The first save is part of the timed loop, as in a training run (ckptd creates its staging ring
then, DCP's stager allocates its buffers); the last save is waited for after the loop, untimed.
The modes run in the order A-B-C-C-B-A and each mode's two runs are averaged; overhead = loop
time / baseline loop time - 1, from the slowest rank.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .harness import Rank, checkpointer, dcp_async, dcp_stager, sharded

MODES = ("none", "ckptd", "ckptd_copy", "ckptd_lazy", "dcp_async_thread", "dcp_async_process")
# ckptd's training modes and their snapshot setting ("auto": the default, a fork snapshot here)
CKPTD_SNAPSHOTS = {"ckptd": "auto", "ckptd_copy": "copy", "ckptd_lazy": "lazy"}


def _step(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(a, b, out=out)


def _step_s(n: int, reps: int) -> float:
    a, out = torch.rand(n, n), torch.empty(n, n)
    _step(a, a, out)
    t0 = time.perf_counter()
    for _ in range(reps):
        _step(a, a, out)
    return (time.perf_counter() - t0) / reps


def calibrate(r: Rank, target_s: float) -> tuple[int, float]:
    """Matrix size whose step takes about ``target_s`` on one thread (agreed by all ranks)."""
    n = 256
    for _ in range(3):  # matmul time grows as n^3: three corrections get within a few percent
        n = int(min(4096, max(64, n * (target_s / max(_step_s(n, 2), 1e-6)) ** (1 / 3))))
    n = int(r.max(float(n)))
    return n, r.max(_step_s(n, 3))


def _updated(state: dict[str, torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """The tensors (or leading parts of them) a step rewrites: ``fraction`` of the state's bytes."""
    out = []
    for t in state.values():
        n = int(t.numel() * fraction)
        if n:
            out.append(t.view(-1)[:n])
    return out


def _loop(r: Rank, mode: str, state: dict[str, torch.Tensor], n: int, every: int, saves: int) -> dict[str, Any]:
    steps = every * saves
    update = _updated(state, r.spec.get("train_update", 0.0))
    a, b, out = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)
    base = Path(r.spec["dir"]) / f"train-{mode}"
    stalls: list[float] = []
    ckpt = checkpointer(r, snapshot=CKPTD_SNAPSHOTS[mode]) if mode in CKPTD_SNAPSHOTS else None
    lazy = mode == "ckptd_lazy"
    stager = dcp_stager(mode) if mode.startswith("dcp_async") else None
    pending: Any = None

    def save(step: int) -> None:
        nonlocal pending
        t0 = time.perf_counter()
        if ckpt is not None:
            pending = ckpt.save(sharded(state), step=r.next_step())
        elif stager is not None:
            if pending is not None:
                pending.result()
            pending = dcp_async(state, base / f"step{step + 1}", mode, stager)
        stalls.append(time.perf_counter() - t0)

    def finish() -> None:
        if pending is not None:
            if ckpt is not None:
                pending.wait()
            else:
                pending.result()

    try:
        # No warm-up save: the first save (ckptd creates its staging ring, DCP's stager allocates
        # its buffers) is part of the loop, as it is of a training run.
        r.barrier()
        t0 = time.perf_counter()
        for step in range(steps):
            if mode != "none" and step % every == 0:
                save(step)
            _step(a, b, out)
            if lazy:
                ckpt.before_update()  # type: ignore[union-attr]  # the optimizer's pre-step hook
            for t in update:
                t.neg_()  # memory-bound like an optimizer update; values stay finite
        loop_s = time.perf_counter() - t0
        finish()
    finally:
        if ckpt is not None:
            ckpt.close()
        if stager is not None:
            stager.close()
    loop_s = r.max(loop_s)
    r.rm(base)
    r.rm_steps()
    res: dict[str, Any] = {"loop_s": loop_s, "steps": steps, "steps_per_s": steps / loop_s}
    if stalls:
        res["first_stall_s"] = r.max(stalls[0])
        rest = stalls[1:] or stalls
        res["stall_s_median"] = r.max(sorted(rest)[len(rest) // 2])
        res["stall_s_max"] = r.max(max(rest))
    return res


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def run_training(
    r: Rank, state: dict[str, torch.Tensor], spec: dict[str, Any], persist_s: float | None
) -> dict[str, Any]:
    every, saves = spec["train_every"], spec["train_saves"]
    r.phase("train:calibrate")
    target = (persist_s or 1.0) / every
    n, step_s = calibrate(r, target)
    out: dict[str, Any] = {
        "every": every,
        "saves": saves,
        "matmul_n": n,
        "step_s": step_s,
        "target_step_s": target,
        "update_fraction": spec.get("train_update", 0.0),
    }
    modes = [
        m for m in MODES if m == "none" or m in spec["methods"] or (m in CKPTD_SNAPSHOTS and "ckptd" in spec["methods"])
    ]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    # A-B-C-C-B-A: each mode meets early and late conditions alike (page cache, memory a VM
    # host handed back, other load), and the mean of its two runs is used.
    order = modes + modes[::-1]
    for mode in order:
        r.phase(f"train:{mode}")
        runs[mode].append(_loop(r, mode, state, n, every, saves))
    base_s = _mean([x["loop_s"] for x in runs["none"]])
    for mode in modes:
        loops = runs[mode]
        res: dict[str, Any] = {"runs_s": [x["loop_s"] for x in loops], "steps": loops[0]["steps"]}
        res["loop_s"] = _mean(res["runs_s"])
        res["steps_per_s"] = res["steps"] / res["loop_s"]
        res["overhead"] = res["loop_s"] / base_s - 1.0
        for key in ("first_stall_s", "stall_s_median", "stall_s_max"):
            if key in loops[0]:
                res[key] = max(x[key] for x in loops) if key.endswith("max") else _mean([x[key] for x in loops])
        out[mode] = res
    shutil.rmtree(Path(r.spec["dir"]) / "train-none", ignore_errors=True)
    return out
