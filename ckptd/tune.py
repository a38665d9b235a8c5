"""Save-frequency tuning from measured costs (Young/Daly, CheckFreq-style).

With asynchronous saves, a checkpoint costs training only its *stall* ``δ`` (snapshot time), but a
failure loses the work since the last *committed* checkpoint: on average half an interval plus
the commit latency ``L`` (persist + commit), plus the restart time ``R``. For an interval ``τ`` and
a mean time between failures ``M`` the expected overhead fraction is

    overhead(τ) = δ / τ  +  (τ / 2 + L + R) / M

which is minimized at Young's ``τ* = sqrt(2 δ M)``; Daly's higher-order correction is used when
``δ`` is not small against ``M``. The interval is never shorter than the persist time, or saves
would queue behind each other and stall training on backpressure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import CkptdError


@dataclass(frozen=True)
class TuneInputs:
    stall_s: float  # training time lost per save (time until save() returns)
    persist_s: float  # time from save() to committed
    mtbf_s: float  # mean time between failures of the whole job
    step_s: float | None = None  # seconds per training step, to express the interval in steps
    restart_s: float = 0.0  # time to restart and reload after a failure

    def check(self) -> None:
        for name in ("stall_s", "persist_s", "restart_s", "mtbf_s", "step_s"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise CkptdError(f"tune: {name} must be a finite number of seconds, got {value}")
        for name in ("stall_s", "persist_s", "restart_s"):
            if getattr(self, name) < 0:
                raise CkptdError(f"tune: {name} must be >= 0, got {getattr(self, name)}")
        if self.mtbf_s <= 0:
            raise CkptdError(f"tune: mtbf_s must be > 0, got {self.mtbf_s}")
        if self.step_s is not None and self.step_s <= 0:
            raise CkptdError(f"tune: step_s must be > 0, got {self.step_s}")


@dataclass(frozen=True)
class Recommendation:
    interval_s: float
    interval_steps: int | None
    young_s: float
    daly_s: float
    bound_by_persist: bool
    overhead_fraction: float  # expected fraction of wall time lost to saves + failures

    def explain(self, inp: TuneInputs) -> str:
        lines = [
            f"stall per save δ = {inp.stall_s:.3f} s, persist/commit latency L = {inp.persist_s:.3f} s, "
            f"MTBF M = {inp.mtbf_s:.0f} s, restart R = {inp.restart_s:.1f} s",
            f"Young: τ = sqrt(2·δ·M) = {self.young_s:.1f} s; Daly: {self.daly_s:.1f} s",
        ]
        if self.bound_by_persist:
            lines.append(f"raised to the persist time {inp.persist_s:.1f} s so saves never queue")
        lines.append(
            f"recommended interval: {self.interval_s:.1f} s"
            + (
                f" = every {self.interval_steps} steps (step = {inp.step_s:.3f} s)"
                if self.interval_steps is not None
                else ""
            )
        )
        lines.append(f"expected overhead (saves + lost work): {100 * self.overhead_fraction:.2f}% of wall time")
        return "\n".join(lines)


def overhead_fraction(interval_s: float, inp: TuneInputs) -> float:
    return inp.stall_s / interval_s + (interval_s / 2 + inp.persist_s + inp.restart_s) / inp.mtbf_s


def daly_interval(delta_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum; falls back to M when δ >= 2M."""
    if delta_s >= 2 * mtbf_s:
        return mtbf_s
    r = delta_s / (2 * mtbf_s)
    return math.sqrt(2 * delta_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - delta_s


def recommend(inp: TuneInputs) -> Recommendation:
    inp.check()
    young = math.sqrt(2 * inp.stall_s * inp.mtbf_s)
    daly = daly_interval(inp.stall_s, inp.mtbf_s) if inp.stall_s > 0 else 0.0
    interval = daly
    bound = interval < inp.persist_s
    interval = max(interval, inp.persist_s)
    if interval <= 0:  # before rounding to steps, which would make it one step of nothing measured
        raise CkptdError("tune: stall and persist times are both 0; measure a save first")
    steps = None
    if inp.step_s is not None:
        steps = max(1, math.ceil(interval / inp.step_s))
        interval = steps * inp.step_s
    return Recommendation(interval, steps, young, daly, bound, overhead_fraction(interval, inp))
