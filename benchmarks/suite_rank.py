"""What each rank process of ``ckptd bench all`` runs: saves, reference limits, the job's parts.

A job (:mod:`.harness`) runs the *parts* its spec lists, in order, and rank 0 writes the results
as JSON:

- ``memcpy``: every rank copies its state into warm buffers at once (the floor of any staging);
- ``save``: repeated saves of the state by each method (ckptd, DCP ``save``, DCP ``async_save``
  THREAD and PROCESS), each waited for before the next; with ``write_ref`` a sequential
  write + fsync of the same bytes follows every ckptd save (the reference its persist is held to,
  measured under the same disk conditions);
- ``lazy``: ckptd saves with ``snapshot="lazy"``, fenced before the state changes;
- ``budget``: ckptd saves of the state through a staging ring of ``spec["budget"]`` (a quarter
  of a save by default), each loaded back and compared;
- ``train``: the CPU training loop of :mod:`.suite_train`;
- ``small``: the same saves for a state of many small tensors (ckptd and DCP async PROCESS);
- ``soak``: ``soak_saves`` back-to-back ckptd saves of a ``soak_bytes`` state: memory after each.

Timings are the slowest rank's. Every method's first save is reported apart from the others
(``first_stall_s``: ckptd creates its staging ring then, DCP's stager allocates its buffers,
DCP PROCESS starts its checkpoint process); medians and maxima are of the saves after it.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptd.format.items import libc_sync_file_range

from .harness import (
    GIB,
    Rank,
    checkpointer,
    dcp_async,
    dcp_stager,
    dcp_writer,
    make_state,
    sharded,
    start_rank,
    state_nbytes,
    stop_dcp_process,
)
from .memory import proc_memory, segments_nbytes
from .suite_train import run_training


# --- reference limits -------------------------------------------------------------------------
def memcpy_s(r: Rank, state: dict[str, torch.Tensor], repeats: int = 3) -> float:
    """Best time of all ranks copying their state into warm buffers at once (CUDA state: into
    pinned host buffers, the floor of any device-to-host staging)."""
    cuda = any(v.is_cuda for v in state.values())
    dst = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}
    for k, v in state.items():  # fault the destination pages in
        dst[k].copy_(v)
    times = []
    for _ in range(repeats):
        r.barrier()
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(r.max(time.perf_counter() - t0))
    return min(times)


REF_VARIANTS = {"1 stream": (1, False), "N streams": (0, False), "1 stream, early writeback": (1, True)}


def write_fsync_s(
    directory: Path, nbytes: int, streams: int, writeback: bool = False, chunk_nbytes: int = 64 << 20
) -> float:
    """Sequential write of ``nbytes`` from a warm buffer in ``chunk_nbytes`` writes, split over
    ``streams`` files written by as many threads, each fsynced; the files are removed again.
    ``writeback``: ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` after every chunk, so the disk
    starts while the rest is written (what ckptd's writer does)."""
    sync_file_range = libc_sync_file_range() if writeback else None
    buf = memoryview(bytearray(chunk_nbytes))
    per = nbytes // streams
    paths = [directory / f"write-ref-{i}.bin" for i in range(streams)]

    def one(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left, off = per, 0
            while left > 0:
                n = os.write(fd, buf[: min(left, chunk_nbytes)])
                if sync_file_range is not None:
                    sync_file_range(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, no wait
                left, off = left - n, off + n
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for p in paths:
        p.unlink(missing_ok=True)
    return dt


def write_ref(r: Rank, nbytes: int, streams: int, writeback: bool) -> float | None:
    """Rank 0 writes ``nbytes`` (the node's bytes) while the other ranks wait; GiB/s."""
    r.barrier()
    gibps = None
    if r.rank == 0:
        gibps = nbytes / write_fsync_s(Path(r.spec["dir"]), nbytes, streams, writeback) / GIB
    r.barrier()
    return gibps


# --- saves --------------------------------------------------------------------------------------
def persist_window_s(stall_s: float, durable_s: float) -> float:
    """The persist window of an asynchronous save, one definition for every method: from the end
    of its stall (``save()`` returned) to durable (ckptd: committed, DCP: ``.metadata`` written),
    both the slowest rank's."""
    return max(durable_s - stall_s, 1e-9)


def _summary(rows: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    """Median and max of the repeated saves (the first row is the warm-up)."""
    first, rows = rows[0], rows[1:] or rows[:1]
    out: dict[str, Any] = {"bytes": nbytes, "saves": rows, "first_stall_s": first["stall_s"]}
    for key in rows[0]:
        vals = [row[key] for row in rows if row.get(key) is not None]
        if vals:
            out[f"{key}_median"] = statistics.median(vals)
            out[f"{key}_max"] = max(vals)
    out["persist_gibps"] = nbytes / GIB / out["persist_s_median"] if out.get("persist_s_median") else None
    return out


def save_ckptd(r: Rank, state: dict[str, torch.Tensor], repeats: int, ref_streams: int | None = None) -> dict[str, Any]:
    """ckptd saves; with ``ref_streams`` (the daemon's writer threads), reference writes of the
    node's bytes after each one (:data:`REF_VARIANTS`; ``N`` streams = ``ref_streams``)."""
    nbytes = int(r.sum(state_nbytes(state)))
    rows, refs = [], []

    def reference() -> None:
        refs.append(
            {
                name: write_ref(r, nbytes, streams or ref_streams or 1, wb)
                for name, (streams, wb) in REF_VARIANTS.items()
            }
        )

    with checkpointer(r) as ckpt:
        pid = ckpt.status()["pid"]
        for i in range(repeats + 1):
            # The reference writes go after the save, or before it every other time: whichever
            # runs second reuses the page-cache pages the first freed (cheaper, on a VM much so).
            if ref_streams and i % 2 == 0 and i:
                reference()
            sd = sharded(state)
            r.barrier()
            t0 = time.perf_counter()
            h = ckpt.save(sd, step=r.next_step())
            stall = time.perf_counter() - t0
            h.wait()
            durable = time.perf_counter() - t0
            rec = h.record
            stall, durable = r.max(stall), r.max(durable)
            rows.append(
                {
                    "stall_s": stall,
                    "durable_s": durable,
                    # As every method's: from save() returning to durable (committed).
                    "persist_s": persist_window_s(stall, durable),
                    # The daemon's own write window (waiting for a writer thread, then write +
                    # fsync; not the fork snapshot's copy, not the commit): what the sequential
                    # write + fsync reference is held against (persist_vs_write).
                    "daemon_window_s": r.max((rec.write_queue_s or 0.0) + (rec.persist_s or 0.0)),
                    "daemon_write_s": r.max(rec.persist_s or 0.0),
                    "snapshot_s": r.max(rec.snapshot_s or 0.0),
                }
            )
            r.rm(Path(str(h.path)))  # a local root here
            if ref_streams and i % 2 == 1:
                reference()
    out = _summary(rows, nbytes)
    out["daemon_pid"] = pid
    if refs:
        out["write_ref"] = refs
    return out


def save_dcp(r: Rank, state: dict[str, torch.Tensor], kind: str, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    nbytes = int(r.sum(state_nbytes(state)))
    cuda = any(v.is_cuda for v in state.values())
    stager = None if kind == "dcp_save" else dcp_stager(kind, cuda)
    threads = int(r.spec.get("dcp_thread_count", 1))
    rows = []
    try:
        for i in range(repeats + 1):
            d = Path(r.spec["dir"]) / f"{kind}_{i}"
            r.barrier()
            t0 = time.perf_counter()
            if kind == "dcp_save":
                dcp.save(state, checkpoint_id=str(d), storage_writer=dcp_writer(d, threads))
                stall = durable = time.perf_counter() - t0
                stall, durable = r.max(stall), r.max(durable)
                # A blocking save: it persists inside its stall, so its window is the whole save.
                rows.append({"stall_s": stall, "durable_s": durable, "persist_s": durable})
            else:
                fut = dcp_async(state, d, kind, stager, threads)
                stall = time.perf_counter() - t0
                fut.result()
                durable = time.perf_counter() - t0
                stall, durable = r.max(stall), r.max(durable)
                rows.append({"stall_s": stall, "durable_s": durable, "persist_s": persist_window_s(stall, durable)})
            r.rm(d)
    finally:
        if stager is not None:
            stager.release()
    return _summary(rows, nbytes)


def save_budget(r: Rank, state: dict[str, torch.Tensor], budget: str, saves: int) -> dict[str, Any]:
    """ckptd saves through a staging ring of ``budget`` (e.g. ``0.25x``: a quarter of a save), each
    loaded back and compared with the values saved: the budget holds and nothing is lost to it."""
    import ckptd

    cfg = ckptd.CkptdConfig.from_env(job_id=r.spec["job_id"], staging_budget=budget)
    rows, exact = [], True
    with ckptd.Checkpointer(r.ckptd_root, config=cfg) as ckpt:
        for _ in range(saves):
            for t in state.values():
                t.add_(1.0)  # every save holds other values
            expected = {k: v.clone() for k, v in state.items()}
            r.barrier()
            t0 = time.perf_counter()
            h = ckpt.save(sharded(state), step=r.next_step())
            stall = time.perf_counter() - t0
            h.wait()
            durable = time.perf_counter() - t0
            out = ckpt.load(sharded({k: torch.zeros_like(v) for k, v in state.items()}), step=h.step)
            exact = exact and all(torch.equal(out[k], v) for k, v in expected.items())
            rows.append({"stall_s": r.max(stall), "durable_s": r.max(durable)})
            r.rm(Path(str(h.path)))  # a local root here
        mine = sum(p["ring_nbytes"] for p in ckpt.status()["rings"] if p["rank"] == r.rank and not p["retired"])
    return {
        "budget": budget,
        "saves": rows,
        "bit_exact": r.max(0.0 if exact else 1.0) == 0.0,
        "ring_nbytes": int(r.sum(mine)),
        "state_bytes": int(r.sum(state_nbytes(state))),
    }


def save_lazy(r: Rank, state: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """ckptd saves with ``snapshot="lazy"``: ``save()`` returns after planning, the copies run
    behind; each is fenced by ``before_update()`` (where an optimizer step would change the
    state) after a simulated forward/backward of one memcpy's length."""
    import ckptd

    cfg = ckptd.CkptdConfig.from_env(job_id=r.spec["job_id"], snapshot="lazy")
    rows = []
    with ckptd.Checkpointer(r.ckptd_root, config=cfg) as ckpt:
        for _ in range(repeats + 1):
            r.barrier()
            t0 = time.perf_counter()
            h = ckpt.save(sharded(state), step=r.next_step())
            stall = time.perf_counter() - t0
            t1 = time.perf_counter()
            ckpt.before_update()
            fence = time.perf_counter() - t1
            for t in state.values():
                t.add_(1.0)  # the optimizer step, after the fence
            h.wait()
            rows.append(
                {"stall_s": r.max(stall), "fence_s": r.max(fence), "durable_s": r.max(time.perf_counter() - t0)}
            )
            r.rm(Path(str(h.path)))  # a local root here
    return _summary(rows, int(r.sum(state_nbytes(state))))


def save_soak(r: Rank, state: dict[str, torch.Tensor], saves: int) -> dict[str, Any]:
    """``saves`` back-to-back ckptd saves, each waited for; after every one, the rank's RSS (the
    maximum over ranks), the daemon's RSS and its part beyond the shared rings, and the /dev/shm
    pages the node's staging rings hold (sampled here, right after the save: they must stay flat)."""
    import psutil

    rows = []
    me = psutil.Process()
    with checkpointer(r) as ckpt:
        daemon_pid = ckpt.status()["pid"]
        prefix = ckpt.endpoints.shm_prefix
        for _ in range(saves):
            h = ckpt.save(sharded(state), step=r.next_step())
            h.wait()
            r.rm(h.path)  # barriers: every rank's save is done
            mem = proc_memory(daemon_pid) or {"rss": 0, "private": 0}
            rows.append(
                {
                    "rank_rss": int(r.max(float(me.memory_info().rss))),
                    "daemon_rss": mem["rss"],
                    "daemon_private": mem["private"],
                    "staging_shm": segments_nbytes(prefix),
                }
            )
    return {"saves": saves, "samples": rows}


def run_saves(
    r: Rank,
    state: dict[str, torch.Tensor],
    methods: list[str],
    repeats: int,
    label: str,
    ref_streams: int | None = None,
) -> dict[str, Any]:
    out = {}
    for method in methods:
        r.phase(f"{label}:{method}")
        if method == "ckptd":
            out[method] = save_ckptd(r, state, repeats, ref_streams)
            continue
        try:
            out[method] = save_dcp(r, state, method, repeats)
        except Exception as exc:  # noqa: BLE001 - a baseline that fails here is reported, not fatal
            # Every rank runs the same calls on the same kind of state, so all of them fail alike
            # and meet again at the next phase's barrier.
            out[method] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


# --- the job ------------------------------------------------------------------------------------
def _profiled(r: Rank, fn: Callable[[], Any], name: str) -> Any:
    """Run ``fn``; with ``--profile`` rank 0 writes a cProfile summary of it."""
    prof_dir = r.spec.get("profile_dir")
    if not prof_dir or r.rank != 0:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
        Path(prof_dir, f"{name}.txt").write_text(s.getvalue())


def rank_main(rank: int, world: int, port: int, spec: dict[str, Any]) -> None:
    """Entry point of a spawned rank (see the module docstring)."""
    r = start_rank(rank, world, port, spec)
    device = spec.get("device", "cpu")
    res: dict[str, Any] = {"ranks": world}
    try:
        parts = spec["parts"]
        if {"memcpy", "save", "train"} & set(parts):
            r.phase("setup")
            state = make_state(rank, spec["state_bytes"] // world, spec["tensor_bytes"], device=device)
            res["state_bytes"] = int(r.sum(state_nbytes(state)))
            res["tensors"] = int(r.sum(len(state)))
            if "memcpy" in parts:
                r.phase("memcpy")
                res["memcpy_s"] = memcpy_s(r, state)
            if "save" in parts:
                refs = spec.get("ref_streams")
                res["save"] = _profiled(
                    r, lambda: run_saves(r, state, spec["methods"], spec["repeats"], "save", refs), "save"
                )
            if "lazy" in parts:
                r.phase("lazy")
                res["lazy"] = save_lazy(r, state, spec["repeats"])
            if "budget" in parts:
                r.phase("budget")
                res["budget"] = save_budget(r, state, spec["budget"], 2)
            if "train" in parts:
                persist = res.get("save", {}).get("ckptd", {}).get("durable_s_median")
                res["train"] = run_training(r, state, spec, persist)
            del state
        if "soak" in parts:
            r.phase("soak")
            soak = make_state(rank, spec["soak_bytes"] // world, spec["tensor_bytes"], device=device)
            res["soak"] = save_soak(r, soak, spec["soak_saves"])
            res["soak"]["state_bytes"] = int(r.sum(state_nbytes(soak)))
            del soak
        if "small" in parts:
            r.phase("setup")
            small = make_state(
                rank, spec["small_bytes"] // world, 0, count=max(1, spec["small_tensors"] // world), device=device
            )
            res["small_state_bytes"] = int(r.sum(state_nbytes(small)))
            res["small_tensors"] = int(r.sum(len(small)))
            res["small"] = _profiled(
                r, lambda: run_saves(r, small, spec["small_methods"], spec["repeats"], "small"), "small"
            )
            del small
        r.phase("done")
        stop_dcp_process()
        if rank == 0:
            Path(spec["out_file"]).write_text(json.dumps(res))
        r.barrier()
    finally:
        dist.destroy_process_group()
