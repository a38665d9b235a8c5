"""A training loop that saves every ``every`` steps, timed, for each way of checkpointing.

Shared by ``ckptd bench all``'s training part (:mod:`.suite_train`: a flat state that a matmul
loop rewrites) and ``ckptd bench train`` (:mod:`.train`: a GPT-like model with AdamW, on CPU or
CUDA). A *workload* says what one step does and what a save saves; a *saver* checkpoints it:

- ``none``: no checkpointing (the baseline);
- ``d2h``: no checkpoint either: at each save point a plain copy of the saved tensors into warm
  pinned buffers (CUDA; warm host buffers on CPU), issued back to back, then one synchronisation.
  Its stall is the floor of any snapshot that holds the bytes on the host when it returns, met
  where the save is (after the GPU work training queued before it), which a copy timed after a
  synchronisation (``d2h_floor_s``) is not;
- ``ckptd``: ``Checkpointer.save`` with the default settings; ``ckptd_copy``: ``snapshot="copy"``;
  ``ckptd_lazy``: ``snapshot="lazy"``, fenced before each update (``attach(optimizer)`` where the
  workload has an optimizer, else ``before_update()``); each also as ``<mode>_prepared``, with
  ``Checkpointer.prepare(state)`` before the loop (the staging ring made and, on CUDA, pinned
  ahead of the first save);
- ``dcp_async_thread`` / ``dcp_async_process``: ``async_save(..., THREAD / PROCESS)`` with one
  ``DefaultStager`` reused (shared memory for PROCESS);
- ``dcp_async_pinned``: TorchTitan's ``async_with_pinned_mem``: ``async_save`` PROCESS with one
  ``DefaultStager(StagingOptions(True, True, True, True))`` reused (pinned, shared memory,
  staging in a background thread, non-blocking copies; on CPU the pinned and non-blocking parts,
  which need an accelerator, are off), staging waited for before the next update;
- ``dcp_async_as_called``: ``async_save`` PROCESS without a stager (one built per call);
- ``dcp_best``: the first of ``dcp_async_pinned``, ``dcp_async_thread``, ``dcp_async_as_called``
  that works on the installed torch (see :class:`DcpSaver`; what failed, and why, is reported).

Every reused stager is kept usable across saves on torch 2.11 and 2.12, whose ``DefaultStager``
closes itself after one stage (``harness._kept_stager_class``, pytorch#183413): as on torch 2.13,
it reuses its staging buffers; a result says ``stager_kept_open`` where that was needed.

As DCP requires, a DCP save waits for the previous one's upload before it starts. The first save
is part of the timed loop, as in a training run (ckptd creates and pins its staging ring, DCP's
stager allocates its buffers); the last save is waited for after the loop, untimed. What runs
beside the trainer is started before the timing, for both: ckptd's daemon before the ranks, and
DCP's checkpoint process (its PROCESS executor spawns it at a rank's first ``async_save``) by one
untimed ``async_save`` of a one-element state through the mode's own stager and executor. DCP
writes with ``FileSystemWriter(thread_count=N)``, ``N`` = ckptd's ``writer_threads`` per rank
on the node (at least 1; :func:`.harness.dcp_thread_count`). The loop time
of a CUDA workload ends with a device synchronisation.
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from .harness import Rank, checkpointer, dcp_failure, dcp_stager, dcp_writer, kept_stager

STALL_PHASES = ("plan_s", "copy_s", "handoff_s")
CKPTD_SNAPSHOTS = {"ckptd": "auto", "ckptd_copy": "copy", "ckptd_lazy": "lazy"}
# The same with Checkpointer.prepare(state) before the loop (the ring sized and pinned ahead).
CKPTD_MODES = {**CKPTD_SNAPSHOTS, **{f"{m}_prepared": v for m, v in CKPTD_SNAPSHOTS.items()}}
DCP_BEST_ORDER = ("dcp_async_pinned", "dcp_async_thread", "dcp_async_as_called")


class Workload(Protocol):
    """One rank's training: what a step does and what a save saves."""

    optimizer: Any  # a torch.optim.Optimizer, or None (the update is not an optimizer step)
    cuda: bool

    def state(self, step: int) -> dict[str, Any]:
        """What a save of ``step`` saves (built anew each time, as get_state_dict would be)."""

    def compute(self) -> None:
        """Forward and backward: reads the saved state, writes none of it."""

    def update(self) -> None:
        """The optimizer step: rewrites the saved state in place."""


def tensors_of(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, by path (ShardedTensors: their data)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    data = getattr(obj, "data", None)
    if isinstance(data, torch.Tensor) and hasattr(obj, "key"):
        return {path: data}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors_of(v, f"{path}.{k}" if path else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors_of(v, f"{path}.{i}"))
    return out


def sync(w: Workload) -> None:
    if w.cuda:
        torch.cuda.synchronize()


# --- savers ------------------------------------------------------------------------------------
class Saver:
    """No checkpointing; the protocol the others follow."""

    fence_s = 0.0
    pin_s: float | None = None  # ckptd on CUDA: seconds the ring's background pinning took
    pin_error = ""  # ckptd on CUDA: why the pinning stopped, if it failed
    # DCP: closes of its reused stager that the installed torch made inside a stage and the
    # benchmark ignored (torch 2.11/2.12; see harness._kept_stager_class)
    stager_closes_ignored = 0

    def save(self, state: dict[str, Any], step: int) -> None:
        pass

    def before_update(self) -> None:
        pass

    def finish(self) -> None:
        """Wait for the last save (untimed)."""

    def close(self) -> None:
        pass


class CopySaver(Saver):
    """The in-loop device-to-host floor (``d2h`` in the module docstring)."""

    def __init__(self, workload: Workload) -> None:
        self.cuda = workload.cuda
        src = tensors_of(workload.state(0))
        self.buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=self.cuda) for k, v in src.items()}
        for k, v in src.items():  # warm: every page touched (and registered) before the loop
            self.buffers[k].copy_(v)

    def save(self, state: dict[str, Any], step: int) -> None:
        for k, v in tensors_of(state).items():
            self.buffers[k].copy_(v, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()


class CkptdSaver(Saver):
    def __init__(self, r: Rank, workload: Workload, snapshot: str, prepare: bool = False) -> None:
        self.r = r
        self.ckpt = checkpointer(r, snapshot=snapshot)
        self.lazy = snapshot == "lazy"
        self.handle: Any = None
        self.steps: list[int] = []
        self.device_snapshots = 0  # saves taken as device snapshots while the ring was pinned
        self.cuda = workload.cuda
        # per save: whether it began before the ring was pinned (CUDA), so not a steady save
        self.while_pinning: list[bool] = []
        if self.lazy and workload.optimizer is not None:
            self.ckpt.attach(workload.optimizer)
        if prepare:
            self.ckpt.prepare(workload.state(0))

    def save(self, state: dict[str, Any], step: int) -> None:
        ring = self.ckpt._ring.current
        # Not yet made, or chunks still being registered; a ring whose pinning failed or that
        # pins nothing (pin_memory off) is as steady as it gets, and its saves are held to the floor.
        self.while_pinning.append(self.cuda and (ring is None or (ring.pinner is not None and ring.pinner.running)))
        self.handle = self.ckpt.save(state, step=step)
        self.steps.append(step)

    def before_update(self) -> None:
        if self.lazy:
            # attach(optimizer) fences from the optimizer's pre-hook; calling it here first times
            # the fence (the hook's call then finds nothing to wait for).
            t0 = time.perf_counter()
            self.ckpt.before_update()
            self.fence_s += time.perf_counter() - t0

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    def close(self) -> None:
        ring = self.ckpt._ring.current
        if ring is not None and ring.pinner is not None:  # how long pinning the ring took (CUDA)
            self.pin_s = ring.pinner.pinned_s
            self.pin_error = ring.pinner.error
        self.device_snapshots = self.ckpt._ring.device_snapshots_taken
        # Per save, in order: how long it waited for ring space (the daemon still draining an
        # earlier save: backpressure) or for the ring's pinning, within its stall.
        recent = self.ckpt.stats()["recent"]
        self.ring_waits = [rec["queue_wait_s"] for rec in recent]
        # Where each save's stall went (ckptd.client.stats): planning, the snapshot's start, the
        # daemon's round trip.
        self.phases = [{k: rec[k] for k in STALL_PHASES} for rec in recent]
        self.ckpt.close()


def dcp_stager_for(kind: str, cuda: bool) -> Any:
    """The stager of a DCP mode (None: async_save builds one per call)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    if kind == "dcp_async_as_called":
        return None
    if kind == "dcp_async_pinned":
        return kept_stager(StagingOptions(cuda, True, True, cuda))
    return dcp_stager(kind, cuda)


class DcpSaver(Saver):
    """``async_save`` of one DCP mode; the previous save's upload is waited for before the next
    starts, and (async staging) the staging before the next update, as TorchTitan does."""

    def __init__(self, r: Rank, workload: Workload, kind: str) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.r = r
        self.kind = kind
        self.base = Path(r.spec["dir"]) / f"dcp-{kind}"
        self.ctype = AsyncCheckpointerType.THREAD if kind == "dcp_async_thread" else AsyncCheckpointerType.PROCESS
        self.stager = dcp_stager_for(kind, workload.cuda)
        self.thread_count = int(r.spec.get("dcp_thread_count", 1))
        self.upload: Any = None
        self.staging: Any = None
        self.dirs: list[Path] = []
        self._warm(workload.cuda)

    def _warm(self, cuda: bool) -> None:
        """One untimed save of a one-element state through this saver's stager and executor, so
        that DCP's checkpoint process (the PROCESS executor spawns it at a rank's first
        ``async_save``, for seconds) runs before the timed loop, as ckptd's daemon does (started
        before the ranks). The stager's buffers for the real state are still made by the first
        timed save, as ckptd's staging ring is."""
        d = self.base / "warm"
        self._start({"warm": torch.zeros(1, device="cuda" if cuda else "cpu")}, d)
        self.finish()
        self.upload = self.staging = None
        self.fence_s = 0.0
        self.r.rm(d)

    def _start(self, state: dict[str, Any], d: Path) -> None:
        import torch.distributed.checkpoint as dcp

        kw: dict[str, Any] = {
            "checkpoint_id": str(d),
            "storage_writer": dcp_writer(d, self.thread_count),
            "async_checkpointer_type": self.ctype,
        }
        if self.stager is not None:
            kw["async_stager"] = self.stager
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fut = dcp.async_save(state, **kw)
        self.upload = getattr(fut, "upload_completion", fut)
        self.staging = getattr(fut, "staging_completion", None)

    def save(self, state: dict[str, Any], step: int) -> None:
        if self.upload is not None:
            self.upload.result()
        d = self.base / f"step{step}"
        self.dirs.append(d)
        self._start(state, d)

    def before_update(self) -> None:
        if self.staging is not None:
            t0 = time.perf_counter()
            self.staging.result()
            self.fence_s += time.perf_counter() - t0
            self.staging = None

    def finish(self) -> None:
        self.before_update()
        if self.upload is not None:
            self.upload.result()

    def close(self) -> None:
        if self.stager is not None:
            self.stager_closes_ignored = self.stager.closes_ignored
            self.stager.release()


def make_saver(r: Rank, workload: Workload, mode: str) -> Saver:
    if mode == "none":
        return Saver()
    if mode == "d2h":
        return CopySaver(workload)
    if mode in CKPTD_MODES:
        return CkptdSaver(r, workload, CKPTD_MODES[mode], prepare=mode.endswith("_prepared"))
    return DcpSaver(r, workload, mode)


# --- the loop ------------------------------------------------------------------------------------
def stall_figures(
    stalls: list[float],
    while_pinning: list[bool] | None,
    ring_waits: list[float] | None,
    phases: list[dict[str, float]] | None,
) -> dict[str, Any]:
    """One rank's figures of a run's saves: the first save's stall; the steady saves' (those after
    the first that began with the ring pinned: a save inside the pinning waits for its chunks or a
    device snapshot, and is counted apart) median stall, median stall less the wait for ring space
    (the snapshot's own cost), median phases; the longest stall after the first. Medians are
    ``statistics.median`` (of two saves, their mean). A figure without a save to take it from is
    left out."""
    out: dict[str, Any] = {"first_stall_s": stalls[0]}
    rest = stalls[1:] or stalls
    pinning = (while_pinning or [False] * len(stalls))[1:] or [False]
    steady = [s for s, p in zip(rest, pinning, strict=True) if not p]
    in_pinning = [s for s, p in zip(rest, pinning, strict=True) if p]
    out["saves_in_pinning"] = len(in_pinning)
    if in_pinning:
        out["stall_s_in_pinning_max"] = max(in_pinning)
    if steady:
        out["stall_s_median"] = statistics.median(steady)
    if ring_waits is not None and len(ring_waits) == len(stalls):
        out["ring_wait_s"] = list(ring_waits)
        own = [s - w for s, w, p in zip(rest, ring_waits[1:] or ring_waits, pinning, strict=True) if not p]
        if own:
            out["stall_s_own_median"] = statistics.median(own)
    out["stall_s_max"] = max(rest)
    if phases is not None and len(phases) == len(stalls):
        out["first_phases_s"] = dict(phases[0])
        later = [p for p, pin in zip(phases[1:], pinning, strict=False) if not pin]
        if later:
            out["steady_phases_s"] = {k: statistics.median(p[k] for p in later) for k in STALL_PHASES}
    return out


def timed_loop(r: Rank, mode: str, workload: Workload, steps: int, every: int) -> dict[str, Any]:
    """``steps`` steps saving every ``every`` (the first step included); the slowest rank's loop
    time, first and median stall, and fence wait (the time updates waited for a save)."""
    stalls: list[float] = []
    fenced: list[float] = []  # the saver's fence time when each save returned, then at the end
    saver = make_saver(r, workload, mode)
    try:
        r.barrier()
        sync(workload)
        t0 = time.perf_counter()
        for step in range(steps):
            if mode != "none" and step % every == 0:
                state = workload.state(step)
                t1 = time.perf_counter()
                saver.save(state, r.next_step())
                stalls.append(time.perf_counter() - t1)
                fenced.append(saver.fence_s)
            workload.compute()
            saver.before_update()
            workload.update()
        sync(workload)
        loop_s = time.perf_counter() - t0
        fenced.append(saver.fence_s)
        saver.finish()
    finally:
        saver.close()
    res: dict[str, Any] = {"loop_s": r.max(loop_s), "steps": steps, "fence_s": r.max(saver.fence_s)}
    r.progress(f"  {mode}: loop {res['loop_s']:.2f} s, {len(stalls)} saves, {time.perf_counter() - t0:.1f} s in all")
    if saver.pin_s is not None:
        res["pin_s"] = r.max(saver.pin_s)
    if saver.pin_error:
        res["pin_error"] = saver.pin_error[:300]
    if isinstance(saver, CkptdSaver):
        res["device_snapshots"] = int(r.max(saver.device_snapshots))
    if isinstance(saver, DcpSaver):
        res["stager_closes_ignored"] = int(r.max(saver.stager_closes_ignored))
        for d in saver.dirs:
            r.rm(d)
    r.rm_steps()
    if stalls:
        local = stall_figures(
            stalls,
            getattr(saver, "while_pinning", None),
            getattr(saver, "ring_waits", None),
            getattr(saver, "phases", None),
        )
        # The slowest rank's of each figure; every rank makes the same collectives in the same
        # order (a figure one rank lacks is left out on all).
        res["first_stall_s"] = r.max(local["first_stall_s"])
        res["saves_in_pinning"] = int(r.max(local["saves_in_pinning"]))
        if res["saves_in_pinning"]:
            res["stall_s_in_pinning_max"] = r.max(local.get("stall_s_in_pinning_max", 0.0))
        for key in ("stall_s_median", "stall_s_own_median"):
            if not r.max(float(key not in local)):
                res[key] = r.max(local[key])
        if "ring_wait_s" in local:
            res["ring_wait_s"] = [round(r.max(w), 4) for w in local["ring_wait_s"]]
        res["stall_s_max"] = r.max(local["stall_s_max"])
        if "first_phases_s" in local:
            res["first_phases_s"] = {k: r.max(local["first_phases_s"][k]) for k in STALL_PHASES}
            if not r.max(float("steady_phases_s" not in local)):
                res["steady_phases_s"] = {k: r.max(local["steady_phases_s"][k]) for k in STALL_PHASES}
        # What a save blocks training for: save() and the fence waits before the next save (an
        # async stager's staging, a lazy save's copies), the only fair "first save" of DCP's
        # pinned async stager, whose save() returns before it staged anything.
        blocked = [s + fenced[i + 1] - fenced[i] for i, s in enumerate(stalls)]
        res["first_blocked_s"] = r.max(blocked[0])
        res["stalls_s"] = [round(r.max(s), 4) for s in stalls]
        res["blocked_s"] = [round(r.max(b), 4) for b in blocked]
    return res


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def run_modes(
    r: Rank, modes: list[str], workload: Workload, steps: int, every: int, phase: str = "train"
) -> dict[str, Any]:
    """Each mode twice, in the order A-B-C-C-B-A (each meets early and late conditions alike:
    page cache, memory a VM host handed back, other load), then the means. ``dcp_best`` runs the
    first DCP mode that works (:data:`DCP_BEST_ORDER`); the others' errors are reported."""
    out: dict[str, Any] = {}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    chosen: str | None = None
    for mode in modes + modes[::-1]:
        r.phase(f"{phase}:{mode}")
        if mode != "dcp_best":
            runs[mode].append(timed_loop(r, mode, workload, steps, every))
            continue
        for kind in [chosen] if chosen else [k for k in DCP_BEST_ORDER if k not in failed]:
            # A kind is given up after two failures: a PROCESS save's helper process can fail to
            # start once on a loaded machine, which says nothing of the configuration.
            for attempt in (1, 2):
                try:
                    runs[mode].append(timed_loop(r, kind, workload, steps, every))
                    chosen = kind
                    break
                except Exception as exc:  # noqa: BLE001 - a baseline that fails is reported, then the next tried
                    # Every rank runs the same calls on the same kind of state: all fail alike.
                    r.barrier()
                    if attempt == 2:
                        failed[kind] = dcp_failure(exc)[:300]
                    else:
                        r.progress(f"  {kind} failed ({dcp_failure(exc)[:200]}); trying it once more")
            if chosen == kind:
                break
    base_s = _mean([x["loop_s"] for x in runs["none"]]) if runs.get("none") else None
    for mode in modes:
        loops = runs[mode]
        if not loops:
            out[mode] = {"error": "; ".join(f"{k}: {v}" for k, v in failed.items())}
            continue
        res: dict[str, Any] = {"runs_s": [x["loop_s"] for x in loops], "steps": loops[0]["steps"]}
        res["loop_s"] = _mean(res["runs_s"])
        res["steps_per_s"] = res["steps"] / res["loop_s"]
        if base_s:
            res["overhead"] = res["loop_s"] / base_s - 1.0
        res["fence_s"] = _mean([x["fence_s"] for x in loops])
        pins = [x["pin_s"] for x in loops if "pin_s" in x]
        if pins:
            res["pin_s"] = max(pins)
        pin_errors = [x["pin_error"] for x in loops if x.get("pin_error")]
        if pin_errors:
            res["pin_error"] = pin_errors[0]
        if any(x.get("stager_closes_ignored") for x in loops):
            res["stager_kept_open"] = True  # the installed torch would have broken its reuse
        for key in ("stalls_s", "blocked_s", "ring_wait_s", "device_snapshots", "saves_in_pinning"):
            if key in loops[0]:
                res[key] = [x[key] for x in loops]  # per run
        for key in ("first_phases_s", "steady_phases_s"):
            runs_of = [x[key] for x in loops if key in x]
            if runs_of:
                res[key] = {k: _mean([p[k] for p in runs_of]) for k in STALL_PHASES}
        for key in (
            "first_stall_s",
            "first_blocked_s",
            "stall_s_median",
            "stall_s_own_median",
            "stall_s_max",
            "stall_s_in_pinning_max",
        ):
            values = [x[key] for x in loops if key in x]  # a run may have had no steady save
            if values:
                res[key] = max(values) if key.endswith("max") else _mean(values)
        out[mode] = res
    if "dcp_best" in modes:
        out["dcp_best_kind"] = chosen
        out["dcp_failed"] = failed
    return out
