"""The training-loop part of ``ckptd bench all``: what checkpointing costs a CPU training loop.

Each rank runs ``steps`` identical steps (one float32 matmul of an ``n x n`` matrix on one thread,
``n`` calibrated so that ``every`` steps take about as long as one save takes to become durable,
i.e. the shortest interval at which saves do not queue, then an in-place update of
``--train-update`` of the saved state, as an optimizer step rewrites the parameters and its
moments: what a copy-on-write snapshot pays for), saving its state every ``every`` steps, in the
loop of :mod:`.trainloop` (its modes: ``none``, ``ckptd``, ``ckptd_copy``, ``ckptd_lazy``
fenced by ``before_update()`` before the update, ``dcp_async_thread``, ``dcp_async_process``;
the checkpointing modes are those of ``--methods``). Overhead = loop time / baseline loop time
- 1, from the slowest rank, the mean of two runs (A-B-C-C-B-A).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .harness import Rank, sharded
from .trainloop import CKPTD_SNAPSHOTS, run_modes

MODES = ("none", "ckptd", "ckptd_copy", "ckptd_lazy", "dcp_async_thread", "dcp_async_process")


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


class FlatWorkload:
    """A matmul that reads nothing saved, then an in-place rewrite of ``update`` of the state."""

    optimizer = None
    cuda = False

    def __init__(self, state: dict[str, torch.Tensor], n: int, fraction: float) -> None:
        self._state = state
        self._update = _updated(state, fraction)
        self._a, self._b, self._out = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)

    def state(self, step: int) -> dict[str, Any]:
        return sharded(self._state)

    def compute(self) -> None:
        _step(self._a, self._b, self._out)

    def update(self) -> None:
        for t in self._update:
            # Memory-bound like an optimizer update; no update undoes another (a negation would:
            # the state after an even number of steps would equal the saved one), values stay finite.
            t.add_(1.0)


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
    workload = FlatWorkload(state, n, spec.get("train_update", 0.0))
    out.update(run_modes(r, modes, workload, every * saves, every))
    shutil.rmtree(Path(r.spec["dir"]) / "train-none", ignore_errors=True)
    return out
