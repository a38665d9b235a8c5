"""``policy="auto"``: choose the save interval from measured costs while training (CheckFreq-style).

Order of calls, on every rank, once per training step::

    if ckpt.due(step):                  # measures the step time; True on the first call
        ckpt.save(state, step=step)     # after it returns the interval is recomputed

After a rollback (``ckpt.load(sd, step=N)``, then training on from step N) the next save is an
interval after N (:meth:`AutoInterval.after_load`), not at the old branch's next save step.

After each save the interval is recomputed with :func:`ckptd.tune.recommend` from this rank's
measured stall (mean over recent saves), persist/commit latency (mean of committed saves) and
step time (median of recent steps), the configured MTBF and restart time. Every rank must save at
the same steps, so the new interval is agreed on with one ``all_reduce(MAX)`` over the default
process group (the longest any rank asks for), also by a rank whose save raised. The first save's
commit latency is not known yet when it returns, so that save is waited for once (a one-time stall
of one persist, at most ``FIRST_COMMIT_WAIT_S``); a failure stays on its handle. Until a save
commits, the time that wait took stands for the commit latency (a lower bound). A rank that died
holds the others in the agreement until the process group's timeout, as it would hold any of
training's collectives.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import CkptdError
from ..tune import Recommendation, TuneInputs, recommend

log = logging.getLogger(__name__)


def agree_max(value: int) -> int:
    """The largest ``value`` over all ranks (torch.distributed), or ``value`` in a single process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# How long the first save's outcome is waited for (AutoInterval.measure_first_commit), at most.
# Below the default timeouts of NCCL's and gloo's collectives (600 s, 1,800 s): ranks whose save
# raised went into the interval's agreement at once, and wait there for this one.
FIRST_COMMIT_WAIT_S = 300.0


class AutoInterval:
    def __init__(
        self, mtbf_s: float, restart_s: float, world_size: int, agree: Callable[[int], int] = agree_max
    ) -> None:
        if mtbf_s <= 0:
            raise CkptdError(
                f"policy='auto' needs the job's mean time between failures: set mtbf_s > 0 (CKPTD_MTBF_S), got {mtbf_s}"
            )
        if world_size > 1 and agree is agree_max:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise CkptdError(
                    "policy='auto' with several ranks needs torch.distributed initialized "
                    "(the ranks agree on the interval with one all_reduce per save)"
                )
        self.mtbf_s = mtbf_s
        self.restart_s = restart_s
        self.agree = agree
        self.step_times_s: deque[float] = deque(maxlen=50)
        self.last_call_s: float | None = None
        self.last_step: int | None = None  # the step of the last due()
        self.loaded_step: int | None = None  # the step of a load since the last due() (after_load)
        self.next_step: int | None = None
        self.interval_steps: int | None = None
        # The first save's outcome waited for (Checkpointer.save): how long it took. The commit
        # latency's lower bound until a save commits (a failing store's saves commit none).
        self.persist_floor_s: float | None = None
        self.inputs: TuneInputs | None = None  # what the current interval was computed from
        self.recommendation: Recommendation | None = None

    def measure_first_commit(self, future: Any) -> None:
        """Wait once for the first save's outcome (its SaveFuture), whose commit latency the
        interval needs. A failure stays on the handle (its wait() or the next save() raises it); a
        save that failed or did not commit in the wait leaves the time it took as the latency's
        lower bound, so a failing store does not make every step a save, nor every save a wait."""
        t0 = time.monotonic()
        try:
            future.wait(FIRST_COMMIT_WAIT_S)
        finally:
            self.persist_floor_s = time.monotonic() - t0 if future.finished_s is None else future.finished_s

    def due(self, step: int) -> bool:
        now = time.monotonic()
        if self.last_call_s is not None:
            self.step_times_s.append(now - self.last_call_s)
        self.last_call_s = now
        if self.last_step is not None and step < self.last_step and self.interval_steps is not None:
            # The job went back (a rollback: it loaded an older step and trains on from there):
            # the next save is an interval after the step it went back to, not after the last
            # save of the branch it left, which lies ahead by as many steps as it went back.
            start = self.loaded_step if self.loaded_step is not None and self.loaded_step < step else step - 1
            self.next_step = start + self.interval_steps
        self.last_step = step
        self.loaded_step = None
        return self.next_step is None or step >= self.next_step

    def after_load(self, step: int) -> None:
        """A load of ``step`` (a rollback, a resume). Its effect waits for the next :meth:`due`:
        once training goes on below the steps it was at (the steps due() is given, the same on
        every rank, went back), the next save is an interval after ``step``. A load that does not
        take the steps back (one rank's ``load(step=N)`` of an older step to look at it, or a job
        that skips ahead past the steps it went back from) leaves the schedule as it was, so due()
        stays the same on every rank. The time the load took is no training step's."""
        self.loaded_step = step
        self.last_call_s = None

    def after_save(self, step: int, stats: dict[str, Any]) -> None:
        """Recompute and agree on the next save step (every rank calls this at the same step)."""
        stall = (stats.get("stall_s") or {}).get("mean")
        commit = (stats.get("commit_latency_s") or {}).get("mean") or self.persist_floor_s
        if stall is None or commit is None or not self.step_times_s:
            interval = 1  # no step time measured yet (saved on the first due()): measure one more
        else:
            self.inputs = TuneInputs(
                stall_s=stall,
                persist_s=commit,
                mtbf_s=self.mtbf_s,
                step_s=statistics.median(self.step_times_s),
                restart_s=self.restart_s,
            )
            self.recommendation = recommend(self.inputs)
            interval = self.recommendation.interval_steps or 1
        agreed = self.agree(interval)
        if agreed != self.interval_steps:
            log.info(
                "policy=auto: saving every %d steps from step %d%s",
                agreed,
                step,
                "" if self.recommendation is None else f" ({self.recommendation.interval_s:.1f} s)",
            )
        self.interval_steps = agreed
        self.next_step = step + agreed
